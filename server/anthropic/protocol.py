"""Pydantic models of the Anthropic Messages API shapes this server speaks.

Checked against the official anthropic SDK's types (anthropic/types/message*.py,
content blocks, raw stream events). Request models ignore fields they do not
know (clients send `service_tier`, `context_management`, `container`, ...), and
accept `cache_control` anywhere (prompt caching here is automatic: the prompt
cache reuses the longest cached prefix whatever the client marks).

The published OpenAPI document (/openapi.json) is generated from these models,
so what they accept is what the document promises, as in server/openai/protocol.py:
request models are strict (JSON `true` is not the integer 1, `"0.5"` is not a
number; 2.0 is an integer, as JSON Schema counts), and content the server cannot
honour (documents, a block in the wrong role's message) is not in the schema: a
before-validator refuses it with a message that says why, instead of pydantic's
"does not match any of the expected tags". Images are accepted: a
vision-language model sees them, a text-only model refuses a user's image (400,
server/http/images.py). An image or document inside a `tool_result` is accepted
for every model: an agent's tool (Claude Code's Read) put it there, and a
text-only model reads a placeholder instead.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from flashserve.server.http.errors import (
    DepthLimited,
)
from flashserve.server.http.ignored import NotesIgnoredFields
from flashserve.server.openai.protocol import WHOLE

MAX_STOP_SEQUENCES = 16
# Anthropic's tool names (MCP tools in Claude Code: mcp__server__tool) go into
# tool-call markup and parsers' regexes: plain characters only.
TOOL_NAME = r"^[A-Za-z0-9_.:-]+$"
# Content this server cannot read: refused with a clear message.
MEDIA = ("document", "search_result", "container_upload")
# What a tool_result may hold besides text: read by the model as a placeholder.
TOOL_RESULT_MEDIA = ("image", "document")
USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


class _Strict(BaseModel):
    # The published schema's types are what the server takes: pydantic's lax mode
    # would read `true` as 1 and "0.5" as a number.
    model_config = ConfigDict(strict=True)


# -- content blocks in -------------------------------------------------------------


class _Block(_Strict):
    # cache_control, citations and other annotations are accepted and ignored.
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


def _refuse_block(allowed: tuple[str, ...], where: str) -> BeforeValidator:
    """A before-validator for one content block: the clear refusal of media and of a
    block that belongs in another place; other tags are the discriminator's to judge."""

    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if not isinstance(kind, str) or kind in allowed:
            return value
        if kind in MEDIA:
            raise ValueError(
                f"{kind} content blocks are not supported here (send text blocks, or image "
                "blocks to a vision-language model)."
            )
        if kind in USER_BLOCKS or kind in ASSISTANT_BLOCKS:
            raise ValueError(f"{where} cannot hold {kind} blocks.")
        return value

    return BeforeValidator(check)


class MediaBlock(_Block):
    """An image or a document inside a tool_result (Claude Code's Read of a PNG or a
    PDF): the model reads a placeholder in its place (anthropic/translate.py)."""

    type: Literal["image", "document"]
    source: dict[str, Any]


class ImageBlock(_Block):
    """A user's image (`source`: base64 data): for a vision-language model."""

    type: Literal["image"]
    source: dict[str, Any]


ToolResultContent = Annotated[
    TextBlock | MediaBlock,
    Field(discriminator="type"),
    _refuse_block(("text", *TOOL_RESULT_MEDIA), "A tool_result"),
]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[ToolResultContent] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    """Encrypted reasoning from Anthropic's models: accepted in history, not shown to
    this model (it cannot be read)."""

    type: Literal["redacted_thinking"]
    data: str | None = None


UserBlock = Annotated[
    TextBlock | ImageBlock | ToolResultBlock,
    Field(discriminator="type"),
    _refuse_block(USER_BLOCKS, "A user message"),
]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
    _refuse_block(ASSISTANT_BLOCKS, "An assistant message"),
]


class UserMessage(_Strict):
    model_config = ConfigDict(extra="allow")
    role: Literal["user"]
    content: str | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(_Strict):
    model_config = ConfigDict(extra="allow")
    role: Literal["assistant"]
    content: str | Annotated[list[AssistantBlock], Field(min_length=1)]


class SystemMessage(_Strict):
    """A system message inside `messages` (Claude Code's beta
    mid-conversation-system-2026-04-07: its agent list, a background task's
    notification). Rendered as a system turn where it stands when the chat
    template allows it, else folded into the neighbouring user turn
    (chat/system_turns.py)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system"]
    content: str | Annotated[list[TextBlock], Field(min_length=1)]


MessageIn = Annotated[UserMessage | AssistantMessage | SystemMessage, Field(discriminator="role")]


# -- tools ---------------------------------------------------------------------------

# What the validator of AnthropicTool checks, as the document states it: a client
# tool (no `type`, or "custom") needs an object input_schema; a tool of another type
# (Anthropic's own) needs none.
CLIENT_TOOL_NEEDS_SCHEMA = {
    "if": {"properties": {"type": {"enum": [None, "custom"]}}},
    "then": {"required": ["input_schema"], "properties": {"input_schema": {"type": "object"}}},
}


class AnthropicTool(_Strict):
    """A client tool ({name, description, input_schema}), or one of Anthropic's own
    (a `type` such as web_search_20250305 or bash_20250124, no schema), which the
    translation leaves out: this server runs no server tools."""

    model_config = ConfigDict(extra="allow", json_schema_extra=CLIENT_TOOL_NEEDS_SCHEMA)
    name: str = Field(..., min_length=1, max_length=128, pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] | None = Field(
        None, description="a JSON Schema; required unless `type` names one of Anthropic's tools"
    )
    type: str | None = Field(None, description="'custom' (the default), or one of Anthropic's")

    @property
    def is_client_tool(self) -> bool:
        return self.type in (None, "custom")

    @model_validator(mode="after")
    def _schema(self) -> AnthropicTool:
        if self.is_client_tool and self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        return self


class _Choice(_Strict):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_Choice):
    type: Literal["auto"]


class ToolChoiceAny(_Choice):
    type: Literal["any"]


class ToolChoiceTool(_Choice):
    type: Literal["tool"]
    name: str


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingConfig(_Strict):
    """enabled / disabled turn the chat template's `enable_thinking` on or off;
    adaptive leaves the template's default. budget_tokens is accepted, not enforced
    (reasoning and answer share max_tokens)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema", description="a JSON Schema")


class OutputConfig(_Strict):
    """Structured output: `format` is enforced by constrained decoding, as Chat
    Completions' response_format json_schema. `effort` is accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    format: JsonOutputFormat | None = None


# -- requests ------------------------------------------------------------------------


class ConversationFields(_Strict, DepthLimited, NotesIgnoredFields):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str = Field(..., description="the served model id (see GET /v1/models)")
    messages: list[MessageIn] = Field(
        ...,
        min_length=1,
        description="the last message must be the user's or a system message (no prefill)",
    )
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="'any' needs client tools; 'tool' names one of them"
    )
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # The structured-outputs beta's spelling of output_config.format.
    output_format: JsonOutputFormat | None = None

    @property
    def json_schema(self) -> dict[str, Any] | None:
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        return fmt.schema_ if fmt is not None else None


class MessagesRequest(ConversationFields):
    # Required, as in Anthropic's API; an upper bound here, cut to what the
    # model's context leaves after the prompt.
    max_tokens: Annotated[int, Field(ge=1), WHOLE] = Field(
        ..., description="an upper bound: cut to what the model's context leaves"
    )
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=0), WHOLE] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    speculative: bool | None = Field(
        None, description="false: no speculative decoding for this request (flashserve)"
    )


class CountTokensRequest(ConversationFields):
    pass


# -- responses -----------------------------------------------------------------------


class TextBlockOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlockOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlockOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    # Opaque to clients, who send it back with the block; this server ignores it.
    signature: str


ContentBlockOut = TextBlockOut | ToolUseBlockOut | ThinkingBlockOut

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(BaseModel):
    """As Anthropic counts: input_tokens excludes the prompt tokens read from the
    prompt cache (cache_read_input_tokens); their sum is the whole prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlockOut]
    stop_reason: StopReason | None = None  # None only in the stream's message_start
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


# -- stream events (SSE `event:` name = `type`) --------------------------------------


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlockOut


class TextDeltaOut(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ThinkingDeltaOut(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(BaseModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDeltaOut | InputJsonDelta | ThinkingDeltaOut | SignatureDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    """The end: the stop reason, and the final usage (counts overwrite message_start's)."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: AnthropicUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (
    MessageStartEvent
    | PingEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
)
