"""What the OpenAI endpoints share: their sampling fields as engine parameters, usage."""

from __future__ import annotations

from flashserve.engine.generation.requests import SamplingParams
from flashserve.server.http.errors import invalid_request
from flashserve.server.openai.protocol import PromptTokensDetails, SamplingFields, Usage

DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default
# Below this a temperature is greedy decoding, and is sent as 0: sampling divides
# the logits by it, and 1/1e-308 in float32 is inf (every logit -inf or NaN, any
# token drawn, grammars broken).
GREEDY_BELOW = 1e-4


def sampling_params(body: SamplingFields, vocab_size: int) -> SamplingParams:
    bias: dict[int, float] | None = None
    if body.logit_bias:
        bias = {}
        for key, value in body.logit_bias.items():
            token = int(key)
            if not 0 <= token < vocab_size:
                raise invalid_request(
                    f"logit_bias names token id {token}, outside the vocabulary "
                    f"(0..{vocab_size - 1}).",
                    "logit_bias",
                    "invalid_value",
                )
            bias[token] = float(value)
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    return SamplingParams(
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        # top_k at or above the vocabulary size keeps every token: the same as off.
        top_k=body.top_k if body.top_k and 0 < body.top_k < vocab_size else 0,
        min_p=body.min_p or 0.0,
        # OpenAI seeds are signed 64-bit; MLX keys take unsigned ones.
        seed=None if body.seed is None else body.seed % 2**64,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=bias,
    )


def choice_count(body: SamplingFields, max_batch: int) -> int:
    """n, which the batch bounds: every choice decodes in it at once (400 naming n)."""
    n = 1 if body.n is None else body.n
    if n > max_batch:
        raise invalid_request(
            f"n is {n}; this server generates at most {max_batch} choices per request "
            f"(its max_batch).",
            "n",
            "invalid_value",
        )
    return n


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )
