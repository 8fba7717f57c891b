"""Per-request samplers and logits processors, built from mlx-lm's pieces.

Requests share a batch, so a seed cannot go through the global RNG: each
sampled request carries its own key and splits it once per token.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from flashserve.engine.generation.requests import LogitsProcessor, SamplingParams
from flashserve.engine.speculative.accept import Sampling, truncations
from flashserve.engine.vision.prompt import real_tokens

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
    filters = truncations(params.top_p, params.min_p, params.top_k)
    inverse_temperature = 1 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, step_key = mx.random.split(key)
        for apply in filters:
            logprobs = apply(logprobs)
        return mx.random.categorical(logprobs * inverse_temperature, key=step_key)

    return sample


def speculative_sampling(params: SamplingParams, choice: int = 0) -> Sampling | None:
    """How speculative steps sample a request's choice: None when greedy (argmax match)."""
    if params.temperature < GREEDY_BELOW:
        return None
    seed = params.seed + choice if params.seed is not None else None
    return Sampling(params.temperature, params.top_p, params.top_k, params.min_p, seed)


class GuardedProcessors:
    """A request's logits processors; an exception is kept, not raised.

    In a batch, one request's failing processor must fail that request only:
    the step continues with the logits unchanged and the worker ends the
    request with its error afterwards.
    """

    def __init__(self, processors: list[LogitsProcessor], builtin: int = 0):
        """`builtin`: the first processors are mlx-lm's (penalties, logit_bias), which
        depend on the context alone."""
        self.error: Exception | None = None
        self._processors = processors
        self._builtin = builtin

    @property
    def speculative_ok(self) -> bool:
        """Whether a speculative step may call them over drafted tokens, position by
        position, and then continue from a shorter context (engine/speculative/)."""
        extra = self._processors[self._builtin :]
        return all(getattr(p, "speculative_ok", False) for p in extra)

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
    builtin = make_logits_processors(
        logit_bias=params.logit_bias,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1 else None,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
    processors = builtin + list(extra)
    return GuardedProcessors(processors, len(builtin)) if processors else None


def sample_first(
    logits: mx.array, prompt: list[int], sampler: Sampler, processors: GuardedProcessors | None
) -> tuple[int, mx.array]:
    """The first new token from the prompt's last logits, sampled the way mlx-lm's
    BatchGenerator samples every token: processors over the whole context, log-softmax,
    sampler; with the log-softmaxed row it was drawn from. A prefill outside the
    batch (generation/prefill/: layer_major.py, alone.py) hands these logits over."""
    logits = logits.reshape(1, -1)
    if processors is not None:
        # An image's virtual id (vision/prompt.py) is its placeholder's id to a processor.
        logits = processors(mx.array(real_tokens(prompt), dtype=mx.int32), logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return int(sampler(logprobs).item()), logprobs
