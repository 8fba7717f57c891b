"""Pydantic models of /v1/completions (the legacy text completion API).

Strict like server/openai/protocol.py, whose shared pieces (SamplingFields,
WHOLE integers, the refusal helper) they build on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from flashserve.server.openai.protocol import (
    MAX_TOP_LOGPROBS,
    WHOLE,
    SamplingFields,
    Usage,
    only_value,
)

# The server refuses an empty prompt, and more than one prompt, so the schema says so.
PromptText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # Token ids are strict ints: `[[false]]` is not token id 0.
    prompt: (
        PromptText
        | Annotated[list[PromptText], Field(min_length=1, max_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    ) = Field(..., description="one prompt: text or token ids (inside the model's vocabulary)")
    # 0 scores the prompt (echo with logprobs, as lm-evaluation-harness asks); without
    # echo a 400 naming max_tokens.
    max_tokens: Annotated[int, Field(ge=0), WHOLE] | None = Field(
        None, description="prompt + max_tokens must fit the model's context; 0 only with echo"
    )
    echo: bool | None = Field(False, description="the prompt's text (and logprobs) first")
    suffix: str | None = Field(
        None,
        description="fill in the middle: the text after the completion, the prompt the text "
        "before it (needs a model with FIM tokens; not with echo)",
    )
    best_of: Literal[1] | None = Field(None, description="only 1")
    # OpenAI allows 0..5; 20 as vLLM and Chat Completions' top_logprobs.
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WHOLE] | None = Field(
        None, description="each token's logprob and the N most likely tokens at its position"
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        single = value
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"exactly one prompt is supported, got {len(value)}")
            single = value[0]
        if single in ("", []):
            raise ValueError("prompt must not be empty")
        if isinstance(single, list):
            whole = (t for t in single if type(t) is int or (type(t) is float and t.is_integer()))
            ids = [int(t) for t in whole]
            if any(t < 0 for t in ids):
                raise ValueError(f"prompt token id {min(ids)} is outside the vocabulary")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix_without_echo(cls, value: str | None, info: ValidationInfo) -> str | None:
        # The prompt the model reads is the FIM arrangement, not the text echo would show.
        if value and info.data.get("echo"):
            raise ValueError("suffix cannot be used with echo")
        return value

    @field_validator("best_of", mode="before")
    @classmethod
    def _one_best(cls, value: Any) -> Any:
        return only_value(value, 1, "only best_of=1 is supported")


# -- responses -------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """Parallel lists, one entry per token (the echoed prompt's first: no logprob)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(
        default_factory=list, description="the N most likely tokens, and the chosen one"
    )
    text_offset: list[int] = Field(
        default_factory=list, description="where each token starts in the choice's text"
    )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    """Both the /v1/completions response and its stream chunks (same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
