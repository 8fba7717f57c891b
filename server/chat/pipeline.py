"""One chat turn in one pass: plan -> render -> budget -> constrain -> generate -> events.

A dialect hands `start_chat` a ChatRequest and reads the ChatTurn's events;
everything between is here, the same for every dialect.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Sequence
from typing import Any

from flashserve.engine.generation.requests import GenerationRequest, LogitsProcessor, TokenEvent
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.chat.constraints import constraint_processors
from flashserve.server.chat.conversation import (
    ChatOptions,
    ChatRequest,
    ChoiceEvent,
    Finished,
    OutputEvent,
)
from flashserve.server.chat.output import ChatOutput
from flashserve.server.chat.prompts import render_prompt
from flashserve.server.chat.reasoning import THINK
from flashserve.server.chat.tooling import ChatPlan, plan_chat, template_inputs
from flashserve.server.generation import Generation, completion_budget, submit
from flashserve.server.http.images import fetch_images
from flashserve.server.http.lifecycle import RequestTracker


class ChatTurn:
    """A submitted chat generation, read as output events."""

    def __init__(self, generation: Generation, outputs: list[ChatOutput]):
        self.generation = generation
        self._outputs = outputs  # one per choice: each parses its own text

    async def events(self) -> AsyncIterator[OutputEvent]:
        """Deltas as they come, then one Finished, for a turn of one choice (the
        dialects without n). Raises APIError when generation fails."""
        async for choice in self.choice_events():
            yield choice.event

    async def choice_events(self) -> AsyncIterator[ChoiceEvent]:
        """Every choice's deltas as they come (choices interleave), each choice's
        ending with its Finished. Raises APIError when generation fails."""
        held: list[list[TokenEvent]] = [[] for _ in self._outputs]
        async for piece in self.generation.choice_pieces():
            output, tokens = self._outputs[piece.index], held[piece.index]
            tokens.extend(piece.tokens)
            events = output.feed(piece.text)
            done = piece.done
            if done is not None:
                events += output.finish(done.finish_reason)
                events.append(
                    Finished(
                        reason=output.finish_reason(done.finish_reason),
                        prompt_tokens=done.prompt_tokens,
                        completion_tokens=done.completion_tokens,
                        cached_tokens=done.cached_tokens,
                        stop_sequence=done.stop_sequence,
                    )
                )
            for event in events:
                # The tokens go with the first event out: the text they made is in it
                # or was held back (tool-call markup) and is in a later one.
                yield ChoiceEvent(piece.index, event, tuple(tokens))
                tokens.clear()


async def render_chat(
    request: ChatRequest, loaded: LoadedModel, options: ChatOptions
) -> tuple[ChatPlan, str, list[int]]:
    """(plan, prompt text, prompt token ids): what start_chat submits, and what a token
    count (Anthropic's count_tokens) counts, so the two never disagree."""
    # An image URL's bytes become its tokens, so they are fetched before anything renders.
    await fetch_images(request.images, options.images, loaded.vision)
    plan = plan_chat(request, loaded.tokenizer, options)
    messages, tools = template_inputs(plan, request.messages)
    # Earlier turns' think blocks as the model saw them (chat/think_history.py):
    # only for `<think>` models, whose templates that setting knows.
    thinking = options.history_thinking if plan.tooling.reasoning == THINK else "template"
    prompt_text, prompt = await render_prompt(
        loaded.tokenizer,
        messages,
        tools,
        request.chat_template_kwargs,
        options.prompt,
        param=request.messages_param,
        history_thinking=thinking,
        # The images' placeholders become the model's image tokens (engine/vision/prompt.py).
        images=loaded.vision.prompt(request.images) if request.images else None,
    )
    return plan, prompt_text, prompt


async def start_chat(
    request: ChatRequest,
    loaded: LoadedModel,
    engine: Engine,
    options: ChatOptions,
    *,
    request_id: str,
    tracker: RequestTracker | None = None,
    extra_processors: Sequence[LogitsProcessor] = (),
) -> ChatTurn:
    """Validate, render and submit one chat turn (APIError 400 on what cannot be served).

    `extra_processors` join the constraint processors (a caller embedding the
    app may add its own, through server.http.deps.request_logits_processors).
    With n > 1 every further choice gets a shallow copy of each: a processor
    keeps its per-output state in attributes it rebinds.
    """
    tokenizer: Any = loaded.tokenizer
    plan, prompt_text, prompt = await render_chat(request, loaded, options)
    max_tokens = completion_budget(
        len(prompt),
        request.max_tokens,
        loaded.context_length,
        options.default_max_tokens,
        prompt_param=request.messages_param,
        max_tokens_param=request.max_tokens_param,
        clamp=request.clamp_max_tokens,
    )
    # tool_choice required / named and response_format, by constrained decoding.
    constraints = await constraint_processors(plan, tokenizer, prompt_text)

    def processors(choice: int) -> list[LogitsProcessor]:
        extra = extra_processors if choice == 0 else [copy.copy(p) for p in extra_processors]
        return [*constraints(choice), *extra]

    generation = submit(
        engine,
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=request.sampling,
            stop=request.stop,
            logits_processors=processors(0) if request.n == 1 else [],
            request_id=request_id,
            n=request.n,
            logprobs=request.logprobs,
            processor_factory=processors if request.n > 1 else None,
            speculative=request.speculative,
            images=request.images,
        ),
        tracker=tracker,
    )
    return ChatTurn(generation, [ChatOutput(plan, prompt_text) for _ in range(request.n)])
