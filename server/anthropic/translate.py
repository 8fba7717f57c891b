"""An Anthropic Messages body -> the chat pipeline's ChatRequest.

The conversation becomes messages in the chat-template shape: `system` (a
string or text blocks) the system message; an assistant message's text blocks
its content, its `tool_use` blocks its tool_calls (arguments = the input as
JSON text) and its `thinking` blocks its reasoning_content (templates that
show past reasoning read it); a user message's `tool_result` blocks role
"tool" messages, in order, between the user text around them (an image or
document in one is a placeholder: http/ignored.py omitted_media). Tools become
function tools, tool_choice auto / any / tool / none the pipeline's auto /
required / named / none, `disable_parallel_tool_use` parallel_tool_calls
false, and `output_config.format` (structured output) a json_schema
response_format: constrained decoding enforces them as in Chat Completions.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

from flashserve.engine.generation.requests import SamplingParams
from flashserve.server.anthropic.protocol import (
    AssistantMessage,
    ConversationFields,
    ImageBlock,
    MessagesRequest,
    SystemMessage,
    TextBlock,
    ThinkingBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
)
from flashserve.server.chat.conversation import ChatRequest
from flashserve.server.http.errors import invalid_request
from flashserve.server.http.ignored import omitted_media
from flashserve.server.http.images import ImageParts
from flashserve.server.openai.common import GREEDY_BELOW

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0  # Anthropic's default
# What the model sees of a tool_result marked is_error, before the result's text.
TOOL_ERROR_PREFIX = "Error: "


def chat_request(
    body: ConversationFields, vocab_size: int, images: ImageParts | None = None
) -> ChatRequest:
    """The pipeline's request for a Messages (or count_tokens) body; 400 on what
    this server cannot serve and no schema can state (a final assistant message, a
    tool_choice that names no client tool, an image the model cannot take).
    Documents get here only inside a tool_result, as placeholders."""
    images = images or ImageParts(None)
    tools = _tools(body)
    choice = body.tool_choice
    request = ChatRequest(
        messages=template_messages(body, images),
        images=images.images,
        sampling=SamplingParams(),
        tools=tools,
        tool_choice=_tool_choice(choice, tools) if tools or choice else None,
        parallel_tool_calls=not getattr(choice, "disable_parallel_tool_use", None),
        response_format=_response_format(body.json_schema),
        clamp_max_tokens=True,
        chat_template_kwargs=_thinking_kwargs(body),
    )
    if isinstance(body, MessagesRequest):
        request.sampling = _sampling(body, vocab_size)
        request.stop = list(body.stop_sequences or [])
        request.max_tokens = body.max_tokens
        request.speculative = body.speculative is not False
    return request


def _sampling(body: MessagesRequest, vocab_size: int) -> SamplingParams:
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    return SamplingParams(
        # Below GREEDY_BELOW sampling would divide by ~0: greedy instead.
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        # top_k at or above the vocabulary size keeps every token: the same as off.
        top_k=body.top_k if body.top_k and body.top_k < vocab_size else 0,
    )


def _response_format(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    if schema is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _thinking_kwargs(body: ConversationFields) -> dict[str, Any]:
    """`thinking` -> the template's enable_thinking (Qwen3 and others read it; other
    templates ignore it). Without `thinking`, the template's default holds, so a
    reasoning model keeps reasoning: its thinking comes back as thinking blocks."""
    if body.thinking is None or body.thinking.type == "adaptive":
        return {}
    return {"enable_thinking": body.thinking.type == "enabled"}


# -- tools ---------------------------------------------------------------------------


def _tools(body: ConversationFields) -> list[dict[str, Any]] | None:
    tools = []
    for tool in body.tools or []:
        if not tool.is_client_tool:
            # Server tools (web_search, code_execution) and Anthropic-defined client
            # tools (bash, text_editor) have no schema a local model was trained on
            # or could be given. Leaving them out keeps the rest of the request (an
            # agent's whole turn) working; a tool_choice naming one is still a 400.
            log.info("leaving out tool %r of type %r: not a client tool", tool.name, tool.type)
            continue
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description or "",
                    "parameters": tool.input_schema,
                },
            }
        )
    return tools or None


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    if choice is None:
        return "auto"
    if isinstance(choice, ToolChoiceAny):
        if not tools:
            raise invalid_request(
                "tool_choice 'any' needs tools (client tools: Anthropic's own are left out)",
                "tool_choice",
            )
        return "required"
    if isinstance(choice, ToolChoiceTool):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, ToolChoiceNone):
        return "none"
    return "auto"


# -- messages ------------------------------------------------------------------------


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def template_messages(
    body: ConversationFields, images: ImageParts | None = None
) -> list[dict[str, Any]]:
    """The conversation in the shape chat templates read (`images`: the model's; none:
    a text-only model's)."""
    images = images or ImageParts(None)
    if body.messages[-1].role == "assistant":
        # Anthropic continues a final assistant message (a "prefill"); the chat
        # pipeline always opens a new assistant turn, so it would answer anew instead.
        raise invalid_request(
            "A final assistant message (prefill) is not supported: the last message must "
            "be from the user.",
            f"messages.{len(body.messages) - 1}.role",
        )
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    tool_names: dict[str, str] = {}  # tool_use id -> name, for the tool messages
    for i, message in enumerate(body.messages):
        if isinstance(message, SystemMessage):
            # Where it stands; chat/system_turns.py folds it for templates that
            # take a system message only first.
            out.append({"role": "system", "content": system_text(message.content)})
        elif isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif isinstance(message, AssistantMessage):
            out.append(_assistant(message, tool_names))
        else:
            out.extend(_user(message, tool_names, images, f"messages.{i}.content"))
    return out


def _assistant(message: AssistantMessage, tool_names: dict[str, str]) -> dict[str, Any]:
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    # Only the blocks an assistant message may hold (protocol.py refuses the others);
    # redacted_thinking cannot be read: left out.
    for block in message.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            tool_names[block.id] = block.name
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    return out


def _user(
    message: UserMessage, tool_names: dict[str, str], images: ImageParts, param: str
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "\n".join(text)})
            text.clear()

    for j, block in enumerate(message.content):  # text, image, tool_result (protocol.py)
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ImageBlock):
            text.append(images.source(block.source, f"{param}.{j}.source"))
        else:
            flush()
            out.append(_tool_message(block, tool_names, images, f"{param}.{j}.content"))
    flush()
    return out


def _tool_message(
    block: ToolResultBlock, tool_names: dict[str, str], images: ImageParts, param: str
) -> dict[str, Any]:
    if block.content is None or isinstance(block.content, str):
        content = block.content or ""
    else:
        where = "a tool_result (Anthropic Messages)"
        texts = []
        for j, part in enumerate(block.content):
            if isinstance(part, TextBlock):
                texts.append(part.text)
            elif part.type == "image":  # a vision-language model sees it
                add = partial(images.source, part.source, f"{param}.{j}.source")
                texts.append(images.in_tool_output(add, where))
            else:
                texts.append(omitted_media(where, part.type))
        content = "\n".join(texts)
    if block.is_error:
        content = TOOL_ERROR_PREFIX + content
    out = {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
    if block.tool_use_id in tool_names:
        out["name"] = tool_names[block.tool_use_id]  # templates that label results read it
    return out
