"""Pydantic models of the OpenAI API shapes this server speaks.

Checked against the official openai SDK's types (openai/types/chat/*,
openai/types/completion*.py, openai/types/model.py). Request models ignore
fields they do not know (clients send many optional OpenAI fields, e.g. `user`,
`store`, `metadata`), but reject fields they know and cannot honour (n > 1,
logprobs, non-text content) rather than silently dropping them.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from flashserve.server.http.errors import MAX_JSON_DEPTH, nested_deeper_than, too_deep_message

MAX_STOP_STRINGS = 16
# logit_bias keys: token ids in ASCII digits (str.isdigit also takes '²' and
# other digits int() refuses); ten digits cover every vocabulary.
TOKEN_ID_KEY = re.compile(r"\s*-?[0-9]{1,10}\s*", re.ASCII)


# -- shared request fields ------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = Field(None, description="the served model id (default: the served model)")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, data: Any) -> Any:
        # Before any field is read: later steps (templates, schemas, dumps) recurse.
        if nested_deeper_than(data, MAX_JSON_DEPTH):
            raise ValueError(too_deep_message())
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not TOKEN_ID_KEY.fullmatch(key):
                shown = key if len(key) <= 20 else key[:20] + "..."
                raise ValueError(f"keys must be token ids (integers as strings), got {shown!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {key} is {bias}; it must be in [-100, 100]")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# -- chat request ----------------------------------------------------------------------


class ContentPart(BaseModel):
    """A part of a message's content. Only text parts are accepted."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            # repr: the type may hold a lone surrogate, which the error could not carry.
            raise ValueError(
                f"content part type {self.type[:40]!r} is not supported: this server accepts "
                "text only"
            )
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


Content = str | list[ContentPart]


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = ""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        # Chat templates write the arguments back with `tojson`: they must be an object.
        if isinstance(value, str) and value.strip():
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"arguments must be a JSON object string: {exc}") from None
            if not isinstance(parsed, dict):
                raise ValueError("arguments must be a JSON object string")
        return value


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(BaseModel):
    # Unknown keys pass through to the chat template (some use e.g. reasoning_content).
    model_config = ConfigDict(extra="allow")
    name: str | None = None


class SystemMessage(_Message):
    role: Literal["system"]
    content: Content


class DeveloperMessage(_Message):
    role: Literal["developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


ChatMessageIn = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    # Names end up inside tool-call markup and parsers' regexes: keep them plain.
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # Rendered into the chat template; parsing tool calls out of the output is
    # the output processor's job (server/chat/output.py).
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    # Strict: JSON `false` is not 0 (pydantic's lax mode reads booleans as ints).
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# -- completions request ---------------------------------------------------------------


# The server refuses an empty prompt, so the schema says so.
PromptText = Annotated[str, Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # Token ids are strict ints: `[[false]]` is not token id 0.
    prompt: PromptText | list[PromptText] | list[StrictInt] | list[list[StrictInt]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], (str, list)) and len(value) != 1:
            raise ValueError(f"exactly one prompt is supported, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        if self.logprobs is not None:  # 0 asks for the sampled token's logprob: refused too
            raise ValueError("logprobs are not supported")
        return self


# -- responses -------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens reused from the prompt cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def _drop_none(handler: SerializerFunctionWrapHandler, obj: BaseModel, keep: set[str]) -> Any:
    data = handler(obj)
    return {k: v for k, v in data.items() if v is not None or k in keep}


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop_none(handler, self, keep={"content"})


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop_none(handler, self, keep=set())


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop_none(handler, self, keep={"index"})


class ChatDelta(BaseModel):
    """One streamed piece of the assistant message; fields left None are not sent."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _drop_none(handler, self, keep=set())


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(BaseModel):
    """Both the /v1/completions response and its stream chunks (same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashserve"
    context_length: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
