"""A /v1/responses request -> the chat pipeline's ChatRequest.

Input items become messages in the chat-template shape: user / system /
developer messages as they are (developer is system), and each assistant turn
gathered from the items that make it (reasoning -> `reasoning_content`,
assistant message text -> `content`, function_call -> `tool_calls`), closed by
the next user message or function_call_output (-> a `tool` message). An
`input_image` (a data: URL; Codex's --image, and its view_image tool's output)
reaches a vision-language model; a text-only model reads one in a
function_call_output as a placeholder and refuses a user's own (400).
`instructions` and the system messages the input opens with become one system
message (many chat templates accept a system message only first). Items are
validated one by one, so an error names the item as OpenAI does
(`input[2].call_id`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import BaseModel, ValidationError

from flashserve.server.chat.conversation import ChatRequest
from flashserve.server.http.errors import MAX_JSON_DEPTH, invalid_request, nested_deeper_than
from flashserve.server.http.images import ImageParts
from flashserve.server.openai.common import sampling_params
from flashserve.server.openai.protocol import FunctionDefinition, SamplingFields
from flashserve.server.openai.responses_protocol import (
    ContentPartIn,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponseCreateRequest,
)

log = logging.getLogger(__name__)

_ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_TEXT_PARTS = ("input_text", "output_text", "text")
_NO_THINKING = ("none", "minimal")  # reasoning efforts that turn enable_thinking off
# Tool types agents send that a local model cannot run (Codex CLI: local_shell,
# web_search, custom freeform tools): not offered to the model, logged once each
# (for the first few names: the names are the clients', so the set stays bounded).
_ignored_tool_types: set[str] = set()
_IGNORED_TYPES_LOGGED = 64


@dataclass
class ResponsesInput:
    request: ChatRequest
    items: list[dict[str, Any]]  # the conversation so far as items (prior ones first): stored


def chat_request(
    body: ResponseCreateRequest,
    prior_items: list[dict[str, Any]],
    vocab_size: int,
    images: ImageParts | None = None,
) -> ResponsesInput:
    """The pipeline's request for a Responses body continuing `prior_items` (400 on bad input)."""
    images = images or ImageParts(None)
    new = parse_input(body.input, required=body.previous_response_id is None)
    prior = [parse_item(raw, "previous_response_id") for raw in prior_items]
    messages = to_messages([(item, "previous_response_id") for item in prior] + new, images)
    messages = with_instructions(body.instructions, messages)
    if not messages:
        raise invalid_request("input must not be empty.", "input")
    tools = function_tools(body.tools)
    kwargs: dict[str, Any] = {}
    if body.reasoning and body.reasoning.effort in _NO_THINKING:
        kwargs["enable_thinking"] = False
    sampling = SamplingFields(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
    )
    request = ChatRequest(
        messages=messages,
        sampling=sampling_params(sampling, vocab_size),
        tools=tools,
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=response_format(body),
        stop=body.stop_list,
        max_tokens=body.max_output_tokens,
        chat_template_kwargs=kwargs,
        messages_param="input",
        max_tokens_param="max_output_tokens",
        speculative=body.speculative is not False,
        images=images.images,
    )
    items = prior_items + [item.model_dump(exclude_none=True) for item, _ in new]
    return ResponsesInput(request, items)


# -- items ------------------------------------------------------------------------------


def parse_input(raw: str | list[dict[str, Any]] | None, required: bool) -> list[tuple[Any, str]]:
    """The request's input as (item, param) pairs; a string is one user message."""
    # Without previous_response_id there is nothing else to answer (instructions alone
    # are not a conversation): the published schema says so (responses_schema.py).
    if raw is None:
        if required:
            raise invalid_request("'input' is required.", "input", "missing_required_parameter")
        return []
    if required and not raw and isinstance(raw, list):
        raise invalid_request("input must not be empty.", "input")
    if isinstance(raw, str):
        return [(MessageItem(role="user", content=raw), "input")]
    return [(parse_item(item, f"input[{i}]"), f"input[{i}]") for i, item in enumerate(raw)]


def parse_item(raw: Any, param: str) -> InputItem:
    """One input item, validated by its type (400 naming the item's field)."""
    kind = raw.get("type", "message" if "role" in raw else None) if isinstance(raw, dict) else None
    model = _ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        shown = repr(kind)[:60]
        raise invalid_request(
            f"Input item type {shown} is not supported: this server takes message, "
            "function_call, function_call_output and reasoning items.",
            f"{param}.type",
            "unsupported_value",
        )
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as exc:
        error = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        where = param + _path(error.get("loc", ()))
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        code = "missing_required_parameter" if error.get("type") == "missing" else "invalid_value"
        raise invalid_request(f"Invalid input item: {where}: {message}", where, code) from None


def _path(loc: Any) -> str:
    """('content', 'list[ContentPartIn]', 0, 'text') -> '.content[0].text'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and "[" not in part and part not in ("str", "list", "dict"):
            out += f".{part}"
    return out


def _text(
    content: str | list[ContentPartIn], param: str, images: ImageParts, tool_output: bool = False
) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type == "input_image":
            url, at = (part.model_extra or {}).get("image_url"), f"{param}[{j}]"
            add = partial(images.data_url, url, f"{at}.image_url")
            if tool_output:
                texts.append(images.in_tool_output(add, "a function_call_output (Responses)"))
            else:
                images.refuse_text_only(f"{at}.type")
                texts.append(add())
        else:
            shown = repr(part.type)[:60]
            raise invalid_request(
                f"Content part type {shown} (without its text) is not supported: this server "
                "accepts text only (input_text, output_text).",
                f"{param}[{j}].type",
                "unsupported_value",
            )
    return "\n".join(texts)


def _arguments(item: FunctionCallItem, param: str) -> None:
    # Chat templates write the arguments back as an object (`tojson`).
    try:
        value = json.loads(item.arguments) if item.arguments.strip() else {}
    except (json.JSONDecodeError, RecursionError) as exc:
        value = exc
    if not isinstance(value, dict) or nested_deeper_than(value, MAX_JSON_DEPTH):
        raise invalid_request(
            f"function_call arguments must be a JSON object, as text (nested at most "
            f"{MAX_JSON_DEPTH} levels).",
            f"{param}.arguments",
            "invalid_value",
        )


def to_messages(entries: list[tuple[Any, str]], images: ImageParts) -> list[dict[str, Any]]:
    """Items -> chat-template messages, each assistant turn gathered from its items."""
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered
    calls: dict[str, str] = {}  # call_id -> function name, for the outputs that follow

    def close() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn)
            turn = None

    for item, param in entries:
        if isinstance(item, FunctionCallOutputItem):
            close()
            if item.call_id not in calls:
                raise invalid_request(
                    f"No tool call found for function call output with call_id {item.call_id!r}.",
                    f"{param}.call_id",
                    "invalid_value",
                )
            output = _text(item.output, f"{param}.output", images, tool_output=True)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "name": calls[item.call_id],
                    "content": output,
                }
            )
            continue
        if isinstance(item, MessageItem) and item.role != "assistant":
            close()
            role = "user" if item.role == "user" else "system"
            content = _text(item.content, f"{param}.content", images)
            messages.append({"role": role, "content": content})
            continue
        # An assistant turn: reasoning, then text, then calls; anything out of that
        # order starts the next turn.
        if (
            turn is not None
            and not isinstance(item, FunctionCallItem)
            and (turn["content"] or turn.get("tool_calls"))
        ):
            close()
        if turn is None:
            turn = {"role": "assistant", "content": ""}
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            text = "\n".join(p.text for p in parts)
            if text:
                previous = turn.get("reasoning_content")
                turn["reasoning_content"] = f"{previous}\n{text}" if previous else text
        elif isinstance(item, MessageItem):
            turn["content"] = _text(item.content, f"{param}.content", images)
        else:
            _arguments(item, param)
            calls[item.call_id] = item.name
            turn.setdefault("tool_calls", []).append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"},
                }
            )
    close()
    return messages


def with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """`instructions` and the leading system messages, as one system message."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    texts = ([instructions] if instructions else []) + [m["content"] for m in messages[:lead]]
    if not texts:
        return messages
    return [{"role": "system", "content": "\n\n".join(texts)}, *messages[lead:]]


# -- tools and formats ---------------------------------------------------------------------


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> the chat shape; other tool types are left out."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            name = str(kind)[:40]
            if name not in _ignored_tool_types and len(_ignored_tool_types) < _IGNORED_TYPES_LOGGED:
                _ignored_tool_types.add(name)
                log.warning(
                    "tools of type %r are not offered to the model (function tools only); "
                    "accepted and ignored",
                    name,
                )
            continue
        fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        try:
            function = FunctionDefinition.model_validate(fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = f"tools[{i}]" + _path(error.get("loc", ()))
            raise invalid_request(
                f"Invalid tool: {where}: {error.get('msg', 'invalid value')}", where
            ) from None
        out.append({"type": "function", "function": function.model_dump(exclude_none=True)})
    return out or None


def chat_tool_choice(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """auto / none / required / {type: function, name} -> the chat shape."""
    if value is None or isinstance(value, str):
        if value not in (None, "auto", "none", "required"):
            raise invalid_request(
                f"tool_choice must be 'auto', 'none', 'required' or a function, not {value!r}.",
                "tool_choice",
                "invalid_value",
            )
        return value
    name = value.get("name")
    if value.get("type") != "function" or not isinstance(name, str):
        raise invalid_request(
            'tool_choice as an object must be {"type": "function", "name": ...}: this server '
            "offers function tools only.",
            "tool_choice",
            "invalid_value",
        )
    return {"type": "function", "function": {"name": name}}


def response_format(body: ResponseCreateRequest) -> dict[str, Any] | None:
    """text.format -> the pipeline's response_format (enforced by constrained decoding)."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {
            "name": fmt.name or "response",
            "schema": fmt.schema_,
            "strict": fmt.strict,
        },
    }
