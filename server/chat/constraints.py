"""Logits processors that enforce tool_choice (required, named) and response_format.

The plan (chat/tooling.py) says what must hold; chat/structured.py writes it
as a grammar for the model's tool-call format; the engine's llguidance
processor (engine/generation/constraints.py) enforces it token by token.
"""

from __future__ import annotations

import asyncio
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


def _build(plan: ChatPlan, tokenizer: Any, prompt_text: str) -> list[LogitsProcessor]:
    try:
        grammar = _grammar(plan, tokenizer)
    except ConstraintError as exc:
        raise invalid_request(str(exc), exc.param) from None
    if grammar is None:
        return []
    param = "tool_choice" if plan.choice.mode in ("required", "named") else "response_format"
    try:
        compiled = compile_grammar(tokenizer, grammar.text())
        after = None
        markers = plan.tooling.reasoning
        if markers and markers.prompt_opens_reasoning(prompt_text):
            after = list(tokenizer.encode(markers.end, add_special_tokens=False))
        return [GrammarProcessor(tokenizer, compiled, after=after, param=param)]
    except GrammarError as exc:
        raise invalid_request(f"Cannot enforce {param}: {exc}", param) from None


async def constraint_processors(
    plan: ChatPlan, tokenizer: Any, prompt_text: str
) -> list[LogitsProcessor]:
    """Logits processors that enforce tool_choice required/named and response_format.

    Compiling a grammar is CPU work (milliseconds; the tokenizer's first use
    about a second), so it runs off the event loop.
    """
    forced = plan.choice.mode in ("required", "named") and plan.tools
    if not forced and plan.schema is None:
        return []
    return await asyncio.to_thread(_build, plan, tokenizer, prompt_text)
