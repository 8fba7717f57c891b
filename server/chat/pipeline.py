"""One chat turn in one pass: plan -> render -> budget -> constrain -> generate -> events.

A dialect hands `start_chat` a ChatRequest and reads the ChatTurn's events;
everything between is here, the same for every dialect.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from flashserve.engine.generation.requests import GenerationRequest, LogitsProcessor
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import LoadedModel
from flashserve.server.chat.constraints import constraint_processors
from flashserve.server.chat.conversation import ChatOptions, ChatRequest, Finished, OutputEvent
from flashserve.server.chat.output import ChatOutput
from flashserve.server.chat.prompts import render_prompt
from flashserve.server.chat.tooling import plan_chat, template_inputs
from flashserve.server.generation import Generation, completion_budget, submit
from flashserve.server.http.lifecycle import RequestTracker


class ChatTurn:
    """A submitted chat generation, read as output events."""

    def __init__(self, generation: Generation, output: ChatOutput):
        self.generation = generation
        self._output = output

    async def events(self) -> AsyncIterator[OutputEvent]:
        """Deltas as they come, then one Finished. Raises APIError when generation fails."""
        async for piece in self.generation.pieces():
            for event in self._output.feed(piece):
                yield event
        outcome = self.generation.outcome
        assert outcome is not None
        for event in self._output.finish(outcome.finish_reason):
            yield event
        yield Finished(
            reason=self._output.finish_reason(outcome.finish_reason),
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            cached_tokens=outcome.cached_tokens,
        )


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
    """
    tokenizer: Any = loaded.tokenizer
    plan = plan_chat(request, tokenizer, options)
    messages, tools = template_inputs(plan, request.messages)
    prompt_text, prompt = await render_prompt(
        tokenizer,
        messages,
        tools,
        request.chat_template_kwargs,
        options.prompt,
        param=request.messages_param,
    )
    max_tokens = completion_budget(
        len(prompt),
        request.max_tokens,
        loaded.context_length,
        options.default_max_tokens,
        prompt_param=request.messages_param,
        max_tokens_param=request.max_tokens_param,
    )
    # tool_choice required / named and response_format, by constrained decoding.
    processors = await constraint_processors(plan, tokenizer, prompt_text)
    generation = submit(
        engine,
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            sampling=request.sampling,
            stop=request.stop,
            logits_processors=[*processors, *extra_processors],
            request_id=request_id,
        ),
        tracker=tracker,
    )
    return ChatTurn(generation, ChatOutput(plan, prompt_text))
