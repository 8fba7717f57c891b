"""Which drafted tokens a verification pass accepts, and the token after them.

Greedy: a draft token is accepted while it equals the argmax at its position;
the first mismatch is replaced by that argmax (exactly the token plain decoding
would have produced), and after a fully accepted draft the last position's
argmax comes free. The output is the plain decoder's, token for token.

Sampled: standard speculative sampling with the draft as a point mass q
(prompt lookup proposes one token, with certainty). A draft token d is
accepted with probability min(1, p(d)/q(d)) = p(d); on rejection the token is
drawn from the residual max(0, p - q), i.e. p with d removed, renormalised.
Each emitted token is then distributed as p, the target model's distribution
after the request's temperature and top-p / top-k / min-p, the same one
mlx-lm's sampler draws from, so the output distribution is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


def truncations(top_p: float, min_p: float, top_k: int) -> list[Callable[[mx.array], mx.array]]:
    """mlx-lm's top-p, min-p and top-k filters a request asks for, in the order the
    plain sampler applies them (generation/sampling.py uses the same list)."""
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < top_p < 1:
        filters.append(lambda x: apply_top_p(x, top_p))
    if min_p > 0:
        filters.append(lambda x: apply_min_p(x, min_p))
    if top_k > 0:
        filters.append(lambda x: apply_top_k(x, top_k))
    return filters


@dataclass
class Sampling:
    """A sampled request's settings (greedy ones have none)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def probabilities(self, logprobs: mx.array) -> mx.array:
        """p over the vocabulary at each row of (rows, vocab) log-softmaxed logits: the
        distribution the plain sampler (generation/sampling.py) draws from."""
        for apply in truncations(self.top_p, self.min_p, self.top_k):
            logprobs = apply(logprobs)
        return mx.softmax(logprobs.astype(mx.float32) / self.temperature, axis=-1)


def accept_greedy(targets: list[int], draft: list[int]) -> tuple[int, int]:
    """(drafted tokens accepted, the token after them) from each position's argmax
    (targets[j] follows draft[:j])."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n, targets[n]


def accept_sampled(
    probs: np.ndarray, draft: list[int], rng: np.random.Generator
) -> tuple[int, int]:
    """(drafted tokens accepted, the token after them) by speculative sampling;
    probs[j] is p at the position draft[j] was proposed for (len(draft) + 1 rows)."""
    for j, token in enumerate(draft):
        p = probs[j].astype(np.float64)
        if rng.random() < p[token]:
            continue
        p[token] = 0.0  # the residual max(0, p - q) for a point mass q at the draft
        total = p.sum()
        if total <= 0:  # p was the point mass itself: unreachable with rng.random() < 1
            return j, token
        return j, int(rng.choice(p.shape[0], p=p / total))
    p = probs[len(draft)].astype(np.float64)
    return len(draft), int(rng.choice(p.shape[0], p=p / p.sum()))
