"""Pydantic models of the OpenAI Responses API (/v1/responses) this server speaks.

Checked against the official openai SDK's types (openai/types/responses/*):
`Response`, its output items (message / reasoning / function_call), usage, and
the streaming events. The request ignores fields it does not know, accepts the
ones agents send that mean nothing locally (see ResponseCreateRequest), and
refuses the ones it cannot honour (background, conversation, prompt templates,
logprobs) rather than silently dropping them.

Input items are typed here but validated one by one in openai/responses_input.py,
so an error can name the item as OpenAI does (`input[2].call_id`); the document
gets their shape (and the tools') from openai/responses_schema.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from flashserve.server.http.errors import (
    DepthLimited,
)
from flashserve.server.http.ignored import NotesIgnoredFields
from flashserve.server.openai.protocol import MAX_STOP_STRINGS, WHOLE
from flashserve.server.openai.responses_schema import (
    INPUT_OR_PREVIOUS,
    INPUT_SCHEMA,
    TEXT_FORMAT_SCHEMA,
    TOOL_CHOICE_SCHEMA,
    TOOL_SCHEMA,
)

# As in protocol.py, the published schema is what the server takes: request models
# are strict (`true` is not 1), and a field refused beyond one value is typed as that
# value, with a before-validator that says why for every other value.
_STRICT = ConfigDict(strict=True)

# A lone surrogate (JSON's "\\ud800") cannot be encoded as UTF-8: text holding one
# would fail where it is echoed (the response repeats most request fields).
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _refuse(value: Any, allowed: Any, message: str) -> Any:
    if value is not None and not (type(value) is type(allowed) and value == allowed):
        raise ValueError(message)
    return value


# -- request ------------------------------------------------------------------------------


class TextFormat(BaseModel):
    """text.format: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(
        strict=True,
        populate_by_name=True,
        json_schema_extra=TEXT_FORMAT_SCHEMA,  # what _schema_given checks
    )
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="a JSON Schema (json_schema: required)"
    )
    strict: bool | None = None
    description: str | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a json_schema format needs 'schema'")
        return self


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted; a local model has no verbosity knob


class ReasoningConfig(BaseModel):
    model_config = _STRICT
    # none / minimal turn thinking off for templates that read enable_thinking;
    # other efforts leave the template's default.
    effort: str | None = None
    summary: str | None = None  # accepted: reasoning comes as text, never summarised
    generate_summary: str | None = None


Metadata = dict[str, str]


class ResponseCreateRequest(DepthLimited, NotesIgnoredFields):
    """POST /v1/responses.

    Accepted and ignored (no meaning on one local model): prompt_cache_key (the
    prompt cache is automatic, by prefix), service_tier, safety_identifier,
    max_tool_calls (built-in tools only), stream_options, text.verbosity,
    reasoning.summary, include (nothing to add: reasoning comes back as plain
    text, never encrypted). truncation "auto" is accepted and behaves as
    "disabled": an input that does not fit the context is a 400.
    """

    model_config = ConfigDict(strict=True, json_schema_extra=INPUT_OR_PREVIOUS)
    model: str | None = Field(None, description="the served model id (default: the served model)")
    # Items are validated one by one (openai/responses_input.py), to name the item.
    input: Annotated[str | list[dict[str, Any]] | None, WithJsonSchema(INPUT_SCHEMA)] = None
    instructions: str | None = Field(
        None, description="system text; not carried over by previous_response_id"
    )
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    tools: list[Annotated[dict[str, Any], WithJsonSchema(TOOL_SCHEMA)]] | None = None
    tool_choice: Annotated[str | dict[str, Any], WithJsonSchema(TOOL_CHOICE_SCHEMA)] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="input + max_output_tokens must fit the model's context"
    )
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    metadata: Metadata | None = None
    include: list[str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: Annotated[int, Field(ge=1), WHOLE] | None = None
    stream_options: dict[str, Any] | None = None
    # Refused when used: this server cannot honour them.
    background: Literal[False] | None = Field(None, description="not supported: only false")
    conversation: None = Field(None, description="not supported: use previous_response_id")
    prompt: None = Field(None, description="prompt templates are not supported")
    top_logprobs: Literal[0] | None = Field(None, description="logprobs are not supported")
    # Beyond the OpenAI API, as in Chat Completions here.
    top_k: Annotated[int, Field(ge=-1), WHOLE] | None = Field(None, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64), WHOLE] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    speculative: bool | None = Field(
        None, description="false: no speculative decoding for this request (flashserve)"
    )

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _has_surrogate(value):
            raise ValueError("the text is not valid Unicode (it holds a lone surrogate)")
        return value

    @field_validator("background", mode="before")
    @classmethod
    def _no_background(cls, value: Any) -> Any:
        return _refuse(value, False, "background responses are not supported")

    @field_validator("conversation", mode="before")
    @classmethod
    def _no_conversation(cls, value: Any) -> Any:
        return _refuse(value, None, "conversations are not supported; use previous_response_id")

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_prompt(cls, value: Any) -> Any:
        return _refuse(value, None, "prompt templates are not supported")

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        return _refuse(value, 0, "logprobs are not supported")

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# -- input items (validated one by one: openai/responses_input.py) --------------------------


class ContentPartIn(BaseModel):
    """A part of an input message: input_text / output_text (text) or refusal."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPartIn]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[ContentPartIn]
    id: str | None = None
    status: str | None = None


class ReasoningPartIn(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning_text", "summary_text", "text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPartIn] = Field(default_factory=list)
    content: list[ReasoningPartIn] | None = None
    encrypted_content: str | None = None  # accepted; never ours, so never readable
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# -- response ------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class SummaryText(BaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputReasoning(BaseModel):
    """The model's reasoning as text (content), never summarised (summary stays empty)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str  # fc_...: the item
    call_id: str  # call_...: what function_call_output answers
    name: str
    arguments: str  # a JSON object, as text
    status: ItemStatus


OutputItem = Annotated[
    OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")
]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="input tokens reused from the prompt cache")
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(0, description="the reasoning text, re-tokenized")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "incomplete", "failed", "in_progress"]


class ResponseObject(BaseModel):
    """A response, and the request fields it echoes (the SDK's `Response`)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    metadata: Metadata = Field(default_factory=dict)
    user: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "default"


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# -- streaming events (each an SSE event named by its type) --------------------------------


class _Event(BaseModel):
    sequence_number: int


class ResponseEvent(_Event):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningTextDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    """A failure after the stream began (then response.failed ends the stream)."""

    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


StreamEvent = (
    ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | OutputTextDeltaEvent
    | OutputTextDoneEvent
    | ReasoningTextDeltaEvent
    | ReasoningTextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
