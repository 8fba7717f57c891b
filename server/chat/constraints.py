"""Logits processors that enforce tool_choice (required, named) and response_format.

The plan (chat/tooling.py) says what must hold; chat/structured.py writes it
as a grammar for the model's tool-call format; the engine's llguidance
processor (engine/generation/constraints.py) enforces it token by token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from flashserve.engine.generation.constraints import (
    GrammarError,
    GrammarProcessor,
    compile_grammar,
    literal,
)
from flashserve.engine.generation.requests import LogitsProcessor
from flashserve.server.chat.structured import (
    ConstraintError,
    Grammar,
    response_format_grammar,
    tool_call_grammar,
)
from flashserve.server.chat.tooling import ChatPlan
from flashserve.server.http.errors import invalid_request

# Choice index -> that choice's own processors (a grammar matcher holds the state of
# one output, so every choice of a request needs its own).
ProcessorFactory = Callable[[int], list[LogitsProcessor]]


def _no_processors(choice: int) -> list[LogitsProcessor]:
    return []


def _grammar(plan: ChatPlan, tokenizer: Any) -> Grammar | None:
    tooling = plan.tooling
    forced = plan.choice.mode in ("required", "named") and plan.tools
    tool_grammar = None
    if plan.tools and (forced or plan.schema is not None):
        if tooling.tool_format is None:
            if forced:
                raise ConstraintError(
                    "tool_choice cannot be enforced: tool-call parsing is off (tool_parser none)",
                    "tool_choice",
                )
        else:
            try:
                tool_grammar = tool_call_grammar(
                    tooling.tool_format,
                    plan.tools,
                    plan.choice,
                    plan.parallel,
                    lambda text: literal(tokenizer, text),
                )
            except ConstraintError:
                if forced:
                    raise
    if forced:
        return tool_grammar
    if plan.schema is None:
        return None
    json_grammar = response_format_grammar(plan.schema)
    # With tools on offer (auto), the model may call one instead of answering in JSON.
    return json_grammar if tool_grammar is None else (tool_grammar | json_grammar)


def _build(plan: ChatPlan, tokenizer: Any, prompt_text: str) -> ProcessorFactory:
    try:
        grammar = _grammar(plan, tokenizer)
    except ConstraintError as exc:
        raise invalid_request(str(exc), exc.param) from None
    if grammar is None:
        return _no_processors
    param = "tool_choice" if plan.choice.mode in ("required", "named") else "response_format"
    try:
        compiled = compile_grammar(tokenizer, grammar.text())
        after = None
        markers = plan.tooling.reasoning
        if markers and markers.prompt_opens_reasoning(prompt_text):
            after = list(tokenizer.encode(markers.end, add_special_tokens=False))
        # Built here, so that a grammar the matcher refuses is the client's 400 now.
        first = GrammarProcessor(tokenizer, compiled, after=after, param=param)
    except GrammarError as exc:
        raise invalid_request(f"Cannot enforce {param}: {exc}", param) from None

    def make(choice: int) -> list[LogitsProcessor]:
        # The grammar is compiled once; each further choice gets its own matcher.
        if choice == 0:
            return [first]
        return [GrammarProcessor(tokenizer, compiled, after=after, param=param)]

    return make


async def constraint_processors(
    plan: ChatPlan, tokenizer: Any, prompt_text: str
) -> ProcessorFactory:
    """Choice index -> the logits processors that enforce tool_choice required/named
    and response_format for that choice (none when nothing is enforced).

    Compiling a grammar is CPU work (milliseconds; the tokenizer's first use
    about a second), so it runs off the event loop.
    """
    forced = plan.choice.mode in ("required", "named") and plan.tools
    if not forced and plan.schema is None:
        return _no_processors
    return await asyncio.to_thread(_build, plan, tokenizer, prompt_text)
