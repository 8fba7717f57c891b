"""Per-request samplers and logits processors, built from mlx-lm's pieces.

Requests share a batch, so a seed cannot go through the global RNG: each
sampled request carries its own key and splits it once per token.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from flashserve.engine.generation.requests import LogitsProcessor, SamplingParams

log = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]


# Below this a temperature is greedy: 1/temperature would overflow float32 and the
# sampler would draw any token.
GREEDY_BELOW = 1e-4


def make_request_sampler(params: SamplingParams, choice: int = 0) -> Sampler:
    """The sampler of a request's choice `choice`: a given seed is offset by the
    choice, so each choice has its own stream and the same request repeats them."""
    if params.temperature < GREEDY_BELOW:
        # The shared greedy sampler lets BatchGenerator sample a batch in one call.
        return greedy_sampler
    seed = params.seed + choice if params.seed is not None else secrets.randbits(63)
    key = mx.random.key(seed)
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < params.top_p < 1:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    inverse_temperature = 1 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, step_key = mx.random.split(key)
        for apply in filters:
            logprobs = apply(logprobs)
        return mx.random.categorical(logprobs * inverse_temperature, key=step_key)

    return sample


class GuardedProcessors:
    """A request's logits processors; an exception is kept, not raised.

    In a batch, one request's failing processor must fail that request only:
    the step continues with the logits unchanged and the worker ends the
    request with its error afterwards.
    """

    def __init__(self, processors: list[LogitsProcessor]):
        self.error: Exception | None = None
        self._processors = processors

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.error is not None:
            return logits
        try:
            for processor in self._processors:
                logits = processor(tokens, logits)
        except Exception as exc:
            log.warning("logits processor failed: %s", exc)
            self.error = exc
        return logits


def make_request_processors(
    params: SamplingParams, extra: list[LogitsProcessor]
) -> GuardedProcessors | None:
    processors = make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    ) + list(extra)
    return GuardedProcessors(processors) if processors else None


def sample_first(
    logits: mx.array, prompt: list[int], sampler: Sampler, processors: GuardedProcessors | None
) -> tuple[int, mx.array]:
    """The first new token from the prompt's last logits, sampled the way mlx-lm's
    BatchGenerator samples every token: processors over the whole context, log-softmax,
    sampler; with the log-softmaxed row it was drawn from. A prefill outside the
    batch (generation/prefill.py, shared_prefill.py) hands these logits over."""
    logits = logits.reshape(1, -1)
    if processors is not None:
        logits = processors(mx.array(prompt, dtype=mx.int32), logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return int(sampler(logprobs).item()), logprobs
