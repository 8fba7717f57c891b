"""What one chat request's tools, tool_choice and response_format mean for this model.

`plan_chat` validates them against the model's tool-call format and reasoning
markers (read once per tokenizer); `template_inputs` shows the conversation
and the tools to the chat template. The plan then drives the constraints
(chat/constraints.py) and the output parsing (chat/output.py).
"""

from __future__ import annotations

import hashlib
import json
import string
import weakref
from dataclasses import dataclass
from typing import Any

from flashserve.engine.weights.tokenizer import hf_tokenizer
from flashserve.server.chat.conversation import ChatOptions, ChatRequest
from flashserve.server.chat.reasoning import ReasoningMarkers, resolve_markers
from flashserve.server.chat.structured import (
    ConstraintError,
    ToolChoice,
    parse_tool_choice,
    response_format_schema,
)
from flashserve.server.chat.tool_parsers import (
    ToolFormat,
    resolve_format,
    template_renders_tools,
    tool_instructions,
)
from flashserve.server.http.errors import invalid_request


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


def plan_chat(request: ChatRequest, tokenizer: Any, options: ChatOptions) -> ChatPlan:
    """Validate the request's tool and format fields for this model (400 on error)."""
    tooling = model_tooling(tokenizer, options.tool_parser, options.reasoning_parser)
    tools = request.tools or None
    try:
        choice = parse_tool_choice(request.tool_choice, tools)
        schema = response_format_schema(request.response_format)
    except ConstraintError as exc:
        raise invalid_request(str(exc), exc.param) from None
    return ChatPlan(
        tooling=tooling,
        tools=tools if choice.mode != "none" else None,
        choice=choice,
        parallel=request.parallel_tool_calls,
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
