"""Log-probabilities of sampled tokens and of prompt tokens.

A sampled token's logprobs come from the distribution mlx-lm's sampler
receives: the log-softmax of the logits after the request's processors
(repetition, presence and frequency penalties, logit_bias, grammar
constraints), before temperature and top-p / top-k / min-p truncation. So a
constraint's forbidden tokens have -inf and are never listed, and at
temperature 0 the sampled token is the most likely one listed.

A prompt's logprobs are the model's own distribution at each position (no
processors: nothing was sampled there), what evaluation tools score.
"""

from __future__ import annotations

import math

import mlx.core as mx

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs

TopLogprobs = list[tuple[int, float]]


def _ranked(ids: list[int], values: list[float]) -> TopLogprobs:
    # Ties in id order, so equal requests list equal tokens.
    pairs = sorted(zip(ids, values, strict=True), key=lambda p: (-p[1], p[0]))
    return [(t, v) for t, v in pairs if math.isfinite(v)]


def sampled_logprobs(row: mx.array, token: int, k: int) -> tuple[float, TopLogprobs]:
    """`token`'s logprob in `row` (log-softmaxed, (vocab,) or (1, vocab)) and the k
    most likely tokens, most likely first."""
    row = row.reshape(-1)
    chosen = row[token]
    if k <= 0:
        return float(chosen.item()), []
    top = mx.argpartition(-row, kth=k - 1)[:k]
    values = row[top]
    mx.eval(chosen, top, values)
    return float(chosen.item()), _ranked(top.tolist(), values.tolist())


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def next_token_logprobs(
    logits: mx.array, next_tokens: list[int], k: int
) -> tuple[list[float], list[TopLogprobs]]:
    """For logits (L, vocab) at L positions, the logprob of the token that follows
    each position and the k most likely there. Evaluated at once, so a prompt's
    chunk never holds more than one (L, vocab) array."""
    lp = log_softmax(logits)
    chosen = mx.take_along_axis(lp, mx.array(next_tokens)[:, None], axis=-1)[:, 0]
    if k <= 0:
        mx.eval(chosen)
        return chosen.tolist(), [[] for _ in next_tokens]
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(lp, top, axis=-1)
    mx.eval(chosen, top, values)
    ranked = [_ranked(i, v) for i, v in zip(top.tolist(), values.tolist(), strict=True)]
    return chosen.tolist(), ranked
