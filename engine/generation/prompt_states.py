"""Which cache states the worker keeps in the prompt cache, and when.

Three moments of a sequence in the batch (worker.py calls these), and one
of a prompt with images, prefilled outside it (`prefix_keeper`):
- its prefill reaches prompt[:-1]: the longest prefix any later prompt can
  reuse (BatchGenerator splits each prompt's last token into a segment of its
  own, so the end of the first segment is exactly that state; a prompt whose
  last token runs in its tail, generation/prefill/last_token.py, never stops there:
  `tail_end_pending`). A state that
  can be trimmed is taken only once the first token is out, cut back to
  prompt[:-1]: the stored state shares the live cache's buffers, so the next
  step's write into them copies the whole cache (~50 ms for a 1.2B model's
  800 tokens), and that copy then lands after the first token, not in its
  TTFT. A recurrent state cannot be cut back: it is stored at once;
- it is cancelled part way through its prefill: what was prefilled, so a
  client that gave up (an idle timeout, a dropped connection) and retries
  resumes there instead of at token 0;
- its answer ends: prompt + answer, which the next turn of a conversation
  resends, so that turn prefills only what came after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from flashserve.engine.generation.choices import Choice
from flashserve.engine.generation.memory_guard import MemoryGuard
from flashserve.engine.prompt_cache.cache import PromptCache
from flashserve.engine.streaming.memory import kv_cache_nbytes

log = logging.getLogger(__name__)


def prompt_ends(
    batch: BatchGenerator, active: dict[int, Choice], responses: Any, generated: Any
) -> list[tuple[list[int], list[Any]]]:
    """The states to store, as (tokens, state), of prompts whose prefill reached
    prompt[:-1] in this step (`responses`, the batch's prompt responses) or, for a
    state that can be trimmed, whose first token this step produced (`generated`).
    Taken now, while every sequence is in the batch; stored once the step's tokens
    are out (`PromptCache.store` may copy the state for its disk tier)."""
    ended = [
        r.uid
        for r in responses
        if r.end_of_segment
        and not r.end_of_prompt
        and r.uid in active
        and active[r.uid].handle.request.use_prompt_cache
    ]
    # A sequence this step finished left the batch: its answer's state, stored
    # as it ends, covers prompt[:-1] (trimmed when a later prompt diverges).
    due = [
        r.uid
        for r in generated
        if r.finish_reason is None and r.uid in active and active[r.uid].prompt_end_pending
    ]
    if not ended and not due:
        return []
    states = []
    for uid, (state, tokens) in batch.extract_cache(ended + due).items():
        choice = active[uid]
        prompt = choice.handle.request.prompt_tokens
        if uid in due:
            choice.prompt_end_pending = False
            extra = len(tokens) - (len(prompt) - 1)
            if extra < 0 or not can_trim_prompt_cache(state):
                continue  # (a sliding window that filled meanwhile): nothing exact to keep
            trim_prompt_cache(state, extra)
        elif can_trim_prompt_cache(state):
            choice.prompt_end_pending = True
            continue
        states.append((list(prompt[:-1]), state))
    return states


def tail_end_pending(
    cache: PromptCache | None, config: Any, request: Any, inputs: list[int]
) -> bool:
    """Whether a prompt whose last token runs in its tail (prefill/last_token.py) stores its
    state at prompt[:-1] once its first token is out (cut back by one, as a trimmable
    state is above): when `inputs`, what it prefills, hold more than that token."""
    if cache is None or not config.prompt_prefix_states:
        return False
    return request.use_prompt_cache and len(inputs) > 1


def prefix_keeper(
    cache: PromptCache | None, config: Any, start: Any
) -> Callable[[list[Any]], None] | None:
    """For a prompt with images prefilled alone (prefill/alone.py): what stores its
    state at prompt[:-1], as the batch does for other prompts. A model with recurrent
    state (Qwen3.5's gated delta-net) can reuse nothing shorter than a stored state,
    so the next turn's prompt, which extends this one, starts there."""
    request = start.handle.request
    if cache is None or not config.prompt_prefix_states or not request.use_prompt_cache:
        return None
    if not request.images:
        return None
    return lambda state: cache.store(list(start.prompt[:-1]), state)


def unprefilled(choice: Choice, tokens: list[int]) -> int:
    """Prompt tokens a sequence has not prefilled yet, given the tokens its state
    covers: 0 once its prefill reached prompt[:-1] or it generated."""
    prompt = choice.handle.request.prompt_tokens
    if choice.generated or len(tokens) >= len(prompt) - 1:
        return 0
    return len(prompt) - len(tokens)


def store_cancelled_prefill(
    cache: PromptCache, choice: Choice, state: list[Any], tokens: list[int]
) -> None:
    """Store what a sequence cancelled part way through its prefill prefilled."""
    if choice.handle.request.use_prompt_cache and len(tokens) > choice.cached_tokens:
        cache.store(list(tokens), state)
        log.info(
            "request %s cancelled during its prefill; kept its first %d tokens",
            choice.handle.request.request_id,
            len(tokens),
        )


def store_answers(
    cache: PromptCache | None,
    answers: list[tuple[Choice, Any]],
    guard: MemoryGuard | None = None,
) -> None:
    """Store the states after the prompts and their answers that ended in this step
    (a stop string's end brings none: `response.prompt_cache` is None).

    The worker calls this once the step's tokens went out and before the answers'
    ends do: a client's next turn, sent at the end, then finds the state.
    (Ends first, then the store, would move its cost into that turn's TTFT; only a
    client that waits between turns would gain.) A state is evaluated here: it
    holds the batch's lazy writes of the step after (mlx-lm starts that step
    before handing back the tokens; on the CPU a first token's step leaves it
    lazy, generation/fairness.py), which would otherwise run in the TTFT of the
    prompt that reuses it. The copies take their bytes beside the batch's rows:
    `guard` makes room for them first (memory_guard.py before_store).
    """
    kept = [
        (choice, response)
        for choice, response in answers
        if cache is not None
        and choice.handle.request.use_prompt_cache
        and response.prompt_cache is not None
    ]
    if not kept:
        return
    if guard is not None and guard.lending is not None:  # only a loan needs the bytes
        guard.before_store(kv_cache_nbytes([response.prompt_cache for _, response in kept]))
    mx.eval([c.state for _, response in kept for c in response.prompt_cache])
    for choice, response in kept:
        tokens = list(response.all_tokens)
        request = choice.handle.request
        if request.images:  # the batch saw their real ids (vision/prompt.py): keyed by hash
            tokens[: len(request.prompt_tokens)] = request.prompt_tokens
        cache.store(tokens, response.prompt_cache)  # type: ignore[union-attr]


def store_prompt_ends(cache: PromptCache | None, ends: list[tuple[list[int], list[Any]]]) -> None:
    """Store `prompt_ends`' states (after the step's tokens and ends: a store may copy)."""
    for tokens, state in ends:
        cache.store(tokens, state)  # type: ignore[union-attr]
