"""Tools, tool_choice, response_format and reasoning for one chat request.

The chat route asks this module four things: what the request means for
this model (`plan_chat`: validated tool_choice, the model's tool-call format
and reasoning markers), how to show the conversation to the chat template
(`template_inputs`), which logits processors enforce tool_choice and
response_format (`constraint_processors`), and how to read the output
(`ChatOutputProcessor`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import string
import weakref
from dataclasses import dataclass
from typing import Any

from engine.constraints import GrammarError, GrammarProcessor, compile_grammar, literal
from engine.requests import LogitsProcessor
from engine.tokenizer import hf_tokenizer

from .errors import invalid_request
from .output import OutputProcessor
from .output_parser import OutputParser, Parsed
from .reasoning import ReasoningMarkers, resolve_markers
from .schemas import ChatCompletionRequest, ChatDelta, FunctionDelta, ToolCallDelta
from .structured import (
    ConstraintError,
    Grammar,
    ToolChoice,
    parse_tool_choice,
    response_format_grammar,
    response_format_schema,
    tool_call_grammar,
)
from .tool_parsers import (
    ToolFormat,
    resolve_format,
    template_renders_tools,
    tool_instructions,
)


@dataclass(frozen=True)
class ModelTooling:
    """What a model's tokenizer and chat template say about tools and reasoning."""

    tool_format: ToolFormat | None
    reasoning: ReasoningMarkers | None
    renders_tools: bool  # the template shows `tools` to the model
    short_call_ids: bool  # the template insists on 9-character call ids (Mistral)


_tooling_cache: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def model_tooling(
    tokenizer: Any, tool_parser: str | None, reasoning_parser: str | None
) -> ModelTooling:
    per_tokenizer = _tooling_cache.setdefault(tokenizer, {})
    key = (tool_parser, reasoning_parser)
    if key not in per_tokenizer:
        template = getattr(hf_tokenizer(tokenizer), "chat_template", None)
        per_tokenizer[key] = ModelTooling(
            tool_format=resolve_format(tokenizer, tool_parser),
            reasoning=resolve_markers(tokenizer, reasoning_parser),
            renders_tools=template_renders_tools(tokenizer),
            short_call_ids=isinstance(template, str) and "length != 9" in template,
        )
    return per_tokenizer[key]


@dataclass
class ChatPlan:
    tooling: ModelTooling
    tools: list[dict] | None  # offered to the model; None when there are none or choice is none
    choice: ToolChoice
    parallel: bool
    schema: dict | None  # response_format's JSON schema


def plan_chat(body: ChatCompletionRequest, tokenizer: Any, settings: Any) -> ChatPlan:
    """Validate the request's tool and format fields for this model (400 on error)."""
    tooling = model_tooling(tokenizer, settings.tool_parser, settings.reasoning_parser)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        choice = parse_tool_choice(body.tool_choice, tools)
        schema = response_format_schema(body.response_format)
    except ConstraintError as exc:
        raise invalid_request(str(exc), exc.param) from None
    return ChatPlan(
        tooling=tooling,
        tools=tools if choice.mode != "none" else None,
        choice=choice,
        parallel=body.parallel_tool_calls is not False,
        schema=schema,
    )


# -- prompt ---------------------------------------------------------------------------


_ALNUM = string.ascii_letters + string.digits


def _short_id(call_id: str) -> str:
    """A stable 9-character alphanumeric id for templates that demand one."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = ""
    for _ in range(9):
        digest, r = divmod(digest, len(_ALNUM))
        out += _ALNUM[r]
    return out


def template_inputs(plan: ChatPlan, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for apply_chat_template.

    Call arguments become objects (templates write them with `tojson`).
    A template that ignores `tools` gets them as a system message in Hermes
    format, with earlier calls written out the same way, so any chat model
    can be offered tools.
    """
    tooling = plan.tooling
    inject = bool(plan.tools) and not tooling.renders_tools
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [_template_call(c, tooling.short_call_ids) for c in calls]
            if inject:
                written = "\n".join(
                    "<tool_call>\n"
                    + json.dumps(
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    )
                    + "\n</tool_call>"
                    for c in message.pop("tool_calls")
                )
                message["content"] = "\n".join(filter(None, [message.get("content"), written]))
        if message.get("role") == "tool" and tooling.short_call_ids and message.get("tool_call_id"):
            message["tool_call_id"] = _short_id(message["tool_call_id"])
        out.append(message)
    if not inject:
        return out, plan.tools
    instructions = tool_instructions(plan.tools or [])
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out, None


def _template_call(call: dict, short_ids: bool) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
    out = {**call, "type": "function", "function": function}
    if short_ids and call.get("id"):
        out["id"] = _short_id(call["id"])
    return out


# -- constrained decoding ------------------------------------------------------------------


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
        return [GrammarProcessor(tokenizer, compiled, after=after)]
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


# -- output ---------------------------------------------------------------------------


class ChatOutputProcessor(OutputProcessor):
    """Content, reasoning_content and tool_calls deltas from generated text."""

    def __init__(self, plan: ChatPlan, prompt_text: str):
        markers = plan.tooling.reasoning
        self._parser = OutputParser(
            reasoning=markers,
            in_reasoning=bool(markers and markers.prompt_opens_reasoning(prompt_text)),
            tool_format=plan.tooling.tool_format,
            tools=plan.tools,
        )

    def feed(self, text: str) -> list[ChatDelta]:
        return _deltas(self._parser.feed(text)) if text else []

    def finish(self) -> list[ChatDelta]:
        return _deltas(self._parser.finish())

    def finish_reason(self, engine_reason: str) -> str:
        if self._parser.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def _deltas(parsed: Parsed) -> list[ChatDelta]:
    out = []
    if parsed.reasoning:
        out.append(ChatDelta(reasoning_content=parsed.reasoning))
    if parsed.content:
        out.append(ChatDelta(content=parsed.content))
    for piece in parsed.tool_calls:
        out.append(
            ChatDelta(
                tool_calls=[
                    ToolCallDelta(
                        index=piece.index,
                        id=piece.id,
                        type="function" if piece.id else None,
                        function=FunctionDelta(name=piece.name, arguments=piece.arguments),
                    )
                ]
            )
        )
    return out
