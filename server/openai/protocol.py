"""Pydantic models of the OpenAI API shapes this server speaks.

Checked against the official openai SDK's types (openai/types/chat/*,
openai/types/completion*.py, openai/types/model.py). Request models ignore
fields they do not know (clients send many optional OpenAI fields, e.g. `user`,
`store`, `metadata`), but reject fields they know and cannot honour (best_of >
1, non-text content) rather than silently dropping them.

The published OpenAPI document (/openapi.json) is generated from these models,
so a field's type is what the document promises: request models are strict
(JSON `true` is not the integer 1, `"0.5"` is not a number), and a field the
server refuses beyond one value (best_of, ...) is typed as that one value. A
before-validator on such a field answers the clear message ("only best_of=1 is
supported") instead of pydantic's, for every value but the accepted one.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from flashserve.server.chat.prompts import RESERVED_KWARGS
from flashserve.server.http.errors import (
    DepthLimited,
)
from flashserve.server.http.ignored import NotesIgnoredFields

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and the engine's
# logit_bias keys: token ids in ASCII digits (str.isdigit also takes '²' and
# other digits int() refuses); ten digits cover every vocabulary.
TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}", re.ASCII)
LOGIT_BIAS_SCHEMA = {
    "type": "object",
    "propertyNames": {"pattern": f"^{TOKEN_ID_KEY.pattern}$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "description": "token id (a string of digits, inside the model's vocabulary) -> bias",
}
TOOL_CHOICE_SCHEMA = {
    "anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}},
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
    ],
    "description": "'required' and a named function need tools (that include the function)",
}
RESPONSE_FORMAT_SCHEMA = {
    "anyOf": [
        {"type": "object", "properties": {"type": {"const": "text"}}},
        {
            "type": "object",
            "properties": {"type": {"const": "json_object"}},
            "required": ["type"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "schema": {"type": "object", "description": "a JSON Schema"},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            },
            "required": ["type", "json_schema"],
        },
    ],
    "description": "text (the default when type is left out), json_object or json_schema",
}


def _whole_number(value: Any) -> Any:
    # JSON Schema counts 2.0 as an integer; strict pydantic would not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# On an integer field (after its Field constraints, so that the schema keeps them):
# a JSON integer, or a number with no fraction (2.0), never `true`.
WHOLE = BeforeValidator(_whole_number)


# Keys the server sets itself (server/chat/prompts.py RESERVED_KWARGS); chat_template
# is a client's own template, taken only where allow_client_chat_template is on.
TEMPLATE_KWARGS_SCHEMA = {
    "type": "object",
    "properties": {"chat_template": {"type": ["string", "null"]}},
    "propertyNames": {"not": {"enum": list(RESERVED_KWARGS)}},
    "description": "extra variables for the chat template; chat_template (a Jinja template) "
    "only where the server's allow_client_chat_template is on",
}


def only_value(value: Any, allowed: Any, message: str) -> Any:
    """For a before-validator: None or `allowed` pass (1.0 for 1, as JSON Schema's
    `const` compares; but `true` is not 1), anything else is refused with `message`."""
    if value is None:
        return value
    if isinstance(value, bool) or isinstance(allowed, bool):
        same = value is allowed
    elif isinstance(allowed, int):
        same = isinstance(value, (int, float)) and value == allowed
    else:
        same = type(value) is type(allowed) and value == allowed
    if not same:
        raise ValueError(message)
    return value


# -- shared request fields ------------------------------------------------------------


class _Strict(BaseModel):
    # The published schema's types are what the server takes: pydantic's lax mode
    # would read `true` as 1 and "0.5" as a number.
    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict, DepthLimited, NotesIgnoredFields):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = Field(None, description="the served model id (default: the served model)")
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="prompt + max_tokens must fit the model's context"
    )
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=-1), WHOLE] | None = Field(None, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # Bounds a JSON double holds exactly (the document's numbers are doubles): a
    # signed or an unsigned 64-bit seed.
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64), WHOLE] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: Annotated[dict[str, float], WithJsonSchema(LOGIT_BIAS_SCHEMA)] | None = None
    # The server's max_batch bounds it (a 400 naming n above): all choices decode together.
    n: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="choices to generate (at most the server's max_batch)"
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculative: bool | None = Field(
        None, description="false: no speculative decoding for this request (flashserve)"
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, value: Any) -> Any:
        for key, bias in (value or {}).items() if isinstance(value, dict) else ():
            if not TOKEN_ID_KEY.fullmatch(key):
                shown = key if len(key) <= 20 else key[:20] + "..."
                raise ValueError(f"keys must be token ids (integers as strings), got {shown!r}")
            number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
            if number and not -100.0 <= bias <= 100.0:
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


class ContentPart(_Strict):
    """A part of a message's content. Only text parts are accepted."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "text":
            # repr: the type may hold a lone surrogate, which the error could not carry.
            raise ValueError(
                f"content part type {kind[:40]!r} is not supported: this server accepts text only"
            )
        if kind == "text" and data.get("text") is None:
            raise ValueError("a text content part needs 'text'")
        return data


Content = str | list[ContentPart]


class ImagePart(_Strict):
    """An image (`image_url.url`: a data: URL), in a user's or a tool's message: a
    vision-language model sees it; a text-only model refuses a user's (400) and reads
    a tool's as a placeholder (server/http/images.py)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url"]
    image_url: dict[str, Any]


def _text_or_image(where: str, images: str) -> BeforeValidator:
    """A part's clear refusal of any type but text and image_url (`where`: its message)."""

    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in ("text", "image_url"):
            raise ValueError(
                f"content part type {kind[:40]!r} is not supported{where}: text, or "
                f"image_url ({images})"
            )
        return value

    return BeforeValidator(check)


ToolContentPart = Annotated[
    ContentPart | ImagePart,
    Field(discriminator="type"),
    _text_or_image(" in a tool message", "a text-only model reads it as a placeholder"),
]
UserContentPart = Annotated[
    ContentPart | ImagePart,
    Field(discriminator="type"),
    _text_or_image("", "for a vision-language model"),
]


# A string holding a JSON object (contentSchema is an annotation: no JSON Schema
# validator asserts it, so this is one of the checks beyond the schema).
JSON_OBJECT_TEXT = {"contentMediaType": "application/json", "contentSchema": {"type": "object"}}


class FunctionCall(_Strict):
    name: str
    arguments: Annotated[str, Field(json_schema_extra=JSON_OBJECT_TEXT)] | dict[str, Any] = Field(
        "", description="a JSON object, or a string holding one (or an empty string)"
    )

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


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(_Strict):
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
    content: str | list[UserContentPart]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: str | list[ToolContentPart]
    tool_call_id: str | None = None


ChatMessageIn = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


class FunctionDefinition(_Strict):
    model_config = ConfigDict(extra="allow")
    # Names end up inside tool-call markup and parsers' regexes: keep them plain.
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema")
    strict: bool | None = None


class ToolDefinition(_Strict):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(..., min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1), WHOLE] | None = Field(
        None, description="prompt + max_completion_tokens must fit the model's context"
    )
    # Rendered into the chat template; parsing tool calls out of the output is
    # the output processor's job (server/chat/output.py).
    tools: list[ToolDefinition] | None = None
    # Plain JSON for the chat pipeline (server/chat/structured.py reads it), checked
    # here against the published shape.
    tool_choice: Annotated[str | dict[str, Any], WithJsonSchema(TOOL_CHOICE_SCHEMA)] | None = None
    parallel_tool_calls: bool | None = None
    response_format: Annotated[dict[str, Any], WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] | None = None
    # Its keys are checked where the template renders (server/chat/prompts.py), for
    # every dialect, as the schema states.
    chat_template_kwargs: (
        Annotated[dict[str, Any], WithJsonSchema(TEMPLATE_KWARGS_SCHEMA)] | None
    ) = None
    logprobs: bool | None = Field(
        None, description="each generated token's logprob in choices[].logprobs.content"
    )
    # Above 0 only with logprobs: true (a 400 naming top_logprobs otherwise, as OpenAI).
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WHOLE] | None = Field(
        None, description="the most likely tokens listed at each position; needs logprobs"
    )

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, str):
            raise ValueError(f"must be 'auto', 'none', 'required' or a function, not {value!r}")
        function = value.get("function") if isinstance(value, dict) else None
        if not (
            isinstance(value, dict)
            and value.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
        ):
            raise ValueError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}'
            )
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # null, or not an object: the type check answers
        kind = value.get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            shown = repr(kind)[:40]
            raise ValueError(f"type {shown} is not supported (text, json_object, json_schema)")
        if kind != "json_schema":
            return value
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        expected = {"name": str, "description": str, "schema": dict, "strict": (bool, type(None))}
        for key, kinds in expected.items():
            if key in spec and not isinstance(spec[key], kinds):
                raise ValueError(f"json_schema.{key} has the wrong type")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# -- completions request ---------------------------------------------------------------


# -- responses -------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens reused from the prompt cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def _is_none(value: Any) -> bool:
    return value is None


def omitted() -> Any:
    """An optional field left out of a response when it has no value (the published
    schema names it, as optional)."""
    return Field(None, exclude_if=_is_none)


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
    reasoning_content: str | None = omitted()
    tool_calls: list[ToolCallOut] | None = omitted()


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text (U+FFFD for an incomplete character)")
    logprob: float = Field(description="-9999.0 for a token too unlikely to have a value")
    bytes: list[int] | None = Field(None, description="the token's UTF-8 bytes")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(
        description="the most likely tokens at this position, most likely first"
    )


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class FunctionDelta(BaseModel):
    name: str | None = omitted()
    arguments: str | None = omitted()


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = omitted()
    type: Literal["function"] | None = omitted()
    function: FunctionDelta | None = omitted()


class ChatDelta(BaseModel):
    """One streamed piece of the assistant message; fields left None are not sent."""

    role: Literal["assistant"] | None = omitted()
    content: str | None = omitted()
    reasoning_content: str | None = omitted()
    tool_calls: list[ToolCallDelta] | None = omitted()


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashserve"
    # Tokens a request may use; where the memory plan bounds it (--residency auto),
    # the KV that fits, and the model's own context beside it.
    context_length: int | None = None
    model_context_length: int | None = None
    # Several models (--models-dir): whether it is in memory now, its other names,
    # its files' size, and what loading it added to the process's private memory (at
    # least its resident weights).
    state: Literal["loaded", "loading", "not loaded", "failed"] = "loaded"
    aliases: list[str] = []
    size_bytes: int | None = None
    memory_bytes: int | None = None
    load_seconds: float | None = None  # the last load's time
    error: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
