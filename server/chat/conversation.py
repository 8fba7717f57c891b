"""The chat pipeline's own request and output events.

Every API dialect (OpenAI Chat Completions today) translates its request into
a ChatRequest and renders the OutputEvents it gets back; generation, tools,
reasoning and constraints are the pipeline's, never a dialect's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashserve.engine.generation.requests import SamplingParams, TokenEvent
from flashserve.server.http.images import ImageLimits


@dataclass
class ChatRequest:
    """One assistant turn to generate, whatever dialect it came in."""

    # In the shape chat templates read: {"role", "content" (text), "tool_calls":
    # [{"id", "type", "function": {"name", "arguments" (JSON text)}}],
    # "tool_call_id", "name"}; roles system, user, assistant, tool.
    messages: list[dict[str, Any]]
    sampling: SamplingParams
    # Function tools: [{"type": "function", "function": {"name", "description",
    # "parameters"}}]; tool_choice "auto" | "none" | "required" | {"type":
    # "function", "function": {"name"}}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # {"type": "json_object" | "json_schema", ...}
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None  # None: the server's default, capped to the context
    # max_tokens as an upper bound, cut to what the context leaves rather than refused
    # (Anthropic clients send one large value, e.g. Claude Code's 32000, whatever the model).
    clamp_max_tokens: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The dialect's names of the fields an error may point at.
    messages_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    n: int = 1  # choices, each parsed on its own (ChatTurn.choice_events)
    logprobs: int | None = None  # None: none; k: each token's logprob and the k likeliest
    speculative: bool = True  # False: the request opted out of speculative decoding
    # A vision-language model's images (engine.vision.images.Image), in the order of
    # the placeholders the dialect wrote into the messages' text (http/images.py).
    images: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class PromptLimits:
    """Bounds on turning a request into prompt tokens (chat/prompts.py)."""

    timeout: float = 10.0  # seconds to render and tokenize (settings.template_timeout)
    max_chars: int = 8_000_000  # rendered prompt characters
    allow_client_template: bool = False  # chat_template_kwargs.chat_template


@dataclass(frozen=True)
class ChatOptions:
    """The server's settings the pipeline reads."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    default_max_tokens: int | None = None  # unset: what the context has left
    prompt: PromptLimits = PromptLimits()
    stream_keepalive: float = 5.0  # seconds; 0: no keepalive events
    history_thinking: str = "empty"  # template | empty | keep (chat/think_history.py)
    images: ImageLimits = field(default_factory=ImageLimits)


# -- output events ------------------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: the first carries its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolCallDropped:
    """Call `index` was announced (and may have streamed arguments) but did not
    complete as a valid call: non-streaming responses leave it out."""

    index: int


@dataclass(frozen=True)
class Finished:
    reason: str  # stop | length | tool_calls
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache
    stop_sequence: str | None = None  # the request's stop string that ended the turn, if one did


OutputEvent = TextDelta | ReasoningDelta | ToolCallDelta | ToolCallDropped | Finished


@dataclass(frozen=True)
class ChoiceEvent:
    """An output event of choice `index`, with the generated tokens (their logprobs,
    when asked) not yet given with an earlier event of that choice: the text they
    made goes out in this event, or was held back and goes out here or later."""

    index: int
    event: OutputEvent
    tokens: tuple[TokenEvent, ...] = ()
