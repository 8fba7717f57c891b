"""The mlx-lm internals flashserve relies on, named in this module alone.

Speculative decoding uses most of them; the compiled decode step
(generation/decode_step.py) reads and moves BatchKVCache's write position too,
generation/fairness.py asks whether a batch's next step prefills or emits a
sequence's first token, and generation/prefill/last_token.py swaps the batch's prompt
batch for one whose move to generation runs a prompt's tail.

mlx-lm's continuous batching has no public hook for a step that emits several
tokens per sequence, nor for taking a batch's KV cache back per sequence, so
speculation subclasses its GenerationBatch and reads and writes the step state
a plain step keeps (the sampled, not yet run next tokens, the tokens counted
against each limit, the stop matchers, the penalties' token context), swaps
the BatchGenerator's generation batch for its own, and moves BatchKVCache's
write position. Those are private fields that a release may rename without
notice: pyproject.toml pins the mlx-lm range they were checked against, and
`check` looks every one of them up on the installed mlx-lm, naming the first
that is missing, so a release that changes them stops speculation loudly
(Speculation.install logs it and serves plain steps) instead of failing
mid-request.
"""

from __future__ import annotations

import dataclasses
import inspect
from importlib.metadata import version
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache, TokenBuffer
from mlx_lm.sample_utils import greedy_sampler

# GenerationBatch.Response's fields, in the order its constructor takes them.
RESPONSE_FIELDS = ("uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens")


class InternalsChanged(RuntimeError):
    """The installed mlx-lm lacks a field or parameter speculation relies on."""


class GenerationBatchState(GenerationBatch):
    """mlx-lm's GenerationBatch, its private step state under public names."""

    @property
    def pending(self) -> mx.array:
        """Each sequence's next token: sampled, emitted by the next step, not yet run."""
        return self._next_tokens

    @pending.setter
    def pending(self, tokens: mx.array) -> None:
        self._next_tokens = tokens

    @property
    def pending_logprobs(self) -> list[mx.array]:
        """The log-softmaxed row each pending token was drawn from."""
        return self._next_logprobs

    @pending_logprobs.setter
    def pending_logprobs(self, rows: list[mx.array]) -> None:
        self._next_logprobs = rows

    @property
    def emitted_counts(self) -> list[int]:
        """Tokens each sequence has emitted, against its max_tokens (a live list)."""
        return self._num_tokens

    @property
    def stop_matchers(self) -> list[Any]:
        """Each sequence's stop-sequence matcher (`advance(token)`: True at a stop)."""
        return self._matchers

    @property
    def token_contexts(self) -> list[TokenBuffer]:
        """Each sequence's token history as its logits processors see it."""
        return self._token_context


def context_size(buffer: TokenBuffer) -> int:
    """Tokens a processors' context holds."""
    return buffer._size


def set_context_size(buffer: TokenBuffer, size: int) -> None:
    """Cut a processors' context back to `size` tokens (what the KV cache keeps)."""
    buffer._size = size


def generation_batch(batch: BatchGenerator) -> GenerationBatch:
    return batch._generation_batch


def set_generation_batch(batch: BatchGenerator, generation: GenerationBatch) -> None:
    batch._generation_batch = generation


def prompt_batch(batch: BatchGenerator) -> PromptProcessingBatch:
    return batch._prompt_batch


def set_prompt_batch(batch: BatchGenerator, prompts: PromptProcessingBatch) -> None:
    """Swap the batch's prompt batch (generation/prefill/last_token.py: its move to generation)."""
    batch._prompt_batch = prompts


def emitted_counts(batch: BatchGenerator) -> list[int]:
    """Tokens each decoding sequence has emitted (0: its next step emits its first)."""
    return batch._generation_batch._num_tokens


def live_uids(batch: BatchGenerator, uids: list[int]) -> set[int]:
    """Those of `uids` still anywhere in the batch (queued, prefilling or decoding)."""
    return set(batch._find_uids(uids))


def prompts_pending(batch: BatchGenerator) -> bool:
    """Whether the batch's next step prefills prompts (queued or part way through)."""
    return bool(batch._unprocessed_sequences) or bool(batch._currently_processing)


def write_position(cache: BatchKVCache) -> int:
    """The position the next keys are written at, shared by every sequence."""
    return cache._idx


def set_write_position(cache: BatchKVCache, position: int) -> None:
    """Move the position the next keys are written at (a compiled step wrote them)."""
    cache._idx = position


def right_padding_pending(cache: BatchKVCache) -> bool:
    """Whether prompt padding on the right is waiting for `finalize`."""
    return cache._right_padding is not None


def _require(owner: str, obj: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if not hasattr(obj, name):
            raise InternalsChanged(
                f"mlx-lm {version('mlx-lm')}: {owner}.{name} is gone; speculative decoding "
                "reads it (engine/speculative/mlx_lm_internals.py)"
            )


def _require_parameters(owner: str, function: Any, names: tuple[str, ...]) -> None:
    parameters = inspect.signature(function).parameters
    for name in names:
        if name not in parameters:
            raise InternalsChanged(
                f"mlx-lm {version('mlx-lm')}: {owner} takes no {name!r} any more; "
                "speculative decoding passes it (engine/speculative/mlx_lm_internals.py)"
            )


def check() -> None:
    """Look up every internal speculation uses on fresh mlx-lm objects; raise
    InternalsChanged naming the first one missing."""
    generator = BatchGenerator(None)
    _require("BatchGenerator", generator, ("_generation_batch", "_find_uids", "_prompt_batch"))
    _require("BatchGenerator", generator, ("_unprocessed_sequences", "_currently_processing"))
    generation = GenerationBatch.empty(None, greedy_sampler)
    _require(
        "GenerationBatch",
        generation,
        ("_next_tokens", "_next_logprobs", "_num_tokens", "_matchers", "_token_context"),
    )
    _require(
        "GenerationBatch",
        generation,
        ("uids", "tokens", "prompt_cache", "samplers", "fallback_sampler", "logits_processors"),
    )
    _require("GenerationBatch", generation, ("max_tokens", "model", "extract_cache", "filter"))
    fields = tuple(f.name for f in dataclasses.fields(GenerationBatch.Response))
    if fields[: len(RESPONSE_FIELDS)] != RESPONSE_FIELDS:
        raise InternalsChanged(
            f"mlx-lm {version('mlx-lm')}: GenerationBatch.Response's fields are {fields}, "
            f"not {RESPONSE_FIELDS} (engine/speculative/mlx_lm_internals.py)"
        )
    _require("TokenBuffer", TokenBuffer([1]), ("_size", "update_and_fetch"))
    kv = BatchKVCache([0])
    _require("BatchKVCache", kv, ("_idx", "_right_padding", "keys", "values", "offset"))
    _require("BatchKVCache", kv, ("left_padding", "trim", "state"))
    _require_parameters("BatchKVCache.prepare", kv.prepare, ("lengths", "right_padding"))
    recurrent = ArraysCache(1)
    _require("ArraysCache", recurrent, ("cache", "left_padding", "lengths", "finalize"))
    _require_parameters("ArraysCache.prepare", recurrent.prepare, ("lengths",))
