"""A prompt prefilled outside the batch, for requests that need its state whole.

Two kinds of request do: n > 1, whose choices all start from one prefill (the
state is copied per choice, then each samples its own first token), and echo
with logprobs, which needs the model's distribution at every prompt position,
which mlx-lm's BatchGenerator does not keep. The arithmetic is the batch's:
the prompt in chunks of prefill_step_size, its last token in the last one
(`fold`: generation/prefill/last_token.py) or, for a model that does not fold, the
prompt but its last token in chunks, then the last token alone; the last
token's logits give the first new token.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from flashserve.engine.compute import prompt_matmul
from flashserve.engine.generation.logprobs import TopLogprobs, next_token_logprobs
from flashserve.engine.generation.prefill.last_token import last_rows
from flashserve.engine.generation.requests import PromptLogprobsEvent
from flashserve.engine.vision.embed import Embed, real_tokens


class PrefillCancelled(Exception):
    pass


@dataclass
class PromptScores:
    """The prompt's logprobs gathered chunk by chunk (position 0 has none)."""

    tokens: list[int]
    k: int
    logprobs: list[float | None] = field(default_factory=lambda: [None])
    top: list[TopLogprobs | None] = field(default_factory=lambda: [None])

    def add(self, logits: mx.array, start: int) -> None:
        """Logits (L, vocab) at positions start .. start+L-1 score the tokens after them."""
        following = self.tokens[start + 1 : start + 1 + logits.shape[0]]
        chosen, top = next_token_logprobs(logits[: len(following)], following, self.k)
        self.logprobs.extend(chosen)
        self.top.extend(top)

    def event(self) -> PromptLogprobsEvent:
        return PromptLogprobsEvent(list(self.tokens), self.logprobs, self.top)


def prefill_alone(
    model: Any,
    prompt: list[int],
    cache: list[Any],
    start: int,
    step: int,
    scores: PromptScores | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    embed: Embed | None = None,
    keep_prefix: Callable[[list[Any]], None] | None = None,
    fold: bool = False,
) -> mx.array:
    """Run prompt[start:] into `cache` (which holds prompt[:start]); the (vocab,)
    logits after the last token. With `scores` (start must be 0) every position's
    logprobs are gathered on the way. With `embed` (a prompt with images) each
    chunk goes in as its embeddings, the images' features merged in. `keep_prefix`
    is given a copy of the state after prompt[:-1] (when this prefill made it).
    `fold`: the last token runs in the last chunk (last_token.folds said so)."""
    assert scores is None or start == 0, "prompt logprobs need the whole prompt computed"
    end = len(prompt) if fold else len(prompt) - 1
    position = start
    while position < end:
        if cancelled():
            raise PrefillCancelled
        chunk = prompt[position : min(position + step, end)]
        tail = fold and position + len(chunk) == end
        with prompt_matmul.prompt_rows() if fold else nullcontext():
            # Without prompt logprobs only the last row goes on to the LM head.
            rows = last_rows(model, [len(chunk) - 1]) if tail and scores is None else nullcontext()
            with rows:
                logits = _forward(model, chunk, position, cache, embed)
        if scores is not None:
            scores.add(logits[0], position)
        # The chunk's cache update is part of its logits' graph: this computes it.
        mx.eval(logits[0, -1])
        position += len(chunk)
    if fold:
        if keep_prefix is not None and end - 1 > start:
            state = copy.deepcopy(cache)
            # A sliding window that filled cannot be cut back: nothing exact to keep.
            if can_trim_prompt_cache(state) and trim_prompt_cache(state, 1) == 1:
                keep_prefix(state)
        return logits[0, -1]
    if keep_prefix is not None and end > start:
        keep_prefix(copy.deepcopy(cache))
    logits = _forward(model, prompt[end:], end, cache, embed)[0, -1]
    mx.eval(logits)
    return logits


def _forward(
    model: Any, tokens: list[int], position: int, cache: list[Any], embed: Embed | None
) -> mx.array:
    if embed is None:
        return model(mx.array([tokens]), cache=cache)
    inputs = mx.array([real_tokens(tokens)])
    return model(inputs, cache=cache, input_embeddings=embed(position, tokens))
