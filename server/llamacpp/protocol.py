"""Pydantic models of llama.cpp's /infill: its request fields, its /completion response.

Field names and defaults are llama.cpp's (tools/server), so editor plugins written
for llama-server work unchanged. Strict like the OpenAI models (JSON `true` is not
1); fields llama.cpp has and this server does not use (`n_indent`, `samplers`,
`t_max_predict_ms`, `response_fields`, ...) are ignored, as unknown fields are on
every route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flashserve.server.http.errors import (
    DepthLimited,
)
from flashserve.server.openai.protocol import WHOLE

MAX_STOP_WORDS = 16
MAX_EXTRA_CHUNKS = 1024

# llama.cpp's sampling defaults (common/common.h): a request that sets nothing
# samples as it would against llama-server.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class ExtraChunk(_Strict):
    """Another file (or part of one) the fill may draw on."""

    filename: str = Field("tmp", description="its name (llama.cpp's default: tmp)")
    text: str


class InfillRequest(_Strict, DepthLimited):
    input_prefix: str = Field("", description="the code before the cursor")
    input_suffix: str = Field("", description="the code after the cursor")
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA_CHUNKS)] = Field(
        default_factory=list,
        description="other files, put before the current one (repository-level context)",
    )
    prompt: str = Field("", description="text added after input_prefix (the line so far)")
    n_predict: Annotated[int, Field(ge=-1), WHOLE] = Field(
        -1,
        description="most tokens to generate; -1: until the model stops or the context is "
        "full (capped by the server's default_max_tokens when set)",
    )
    temperature: float | None = Field(None, ge=0.0, description="0: greedy (default 0.8)")
    top_k: Annotated[int, WHOLE] | None = Field(None, description="<= 0: off (default 40)")
    top_p: float | None = Field(None, ge=0.0, le=1.0, description="1: off (default 0.95)")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="0: off (default 0.05)")
    seed: Annotated[int, Field(ge=-1, lt=2**64), WHOLE] | None = Field(
        None, description="-1: random"
    )
    repeat_penalty: float | None = Field(None, gt=0.0, description="1: off")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_WORDS)] | None = Field(
        None, description="stop words: the text ends before the first one written"
    )
    stream: bool = False
    cache_prompt: bool = Field(True, description="reuse and keep prompt states (prompt cache)")

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_STOP_WORDS:
            raise ValueError(f"at most {MAX_STOP_WORDS} stop words")
        return value

    @property
    def stop_words(self) -> list[str]:
        words = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [word for word in words if word]


# -- responses -------------------------------------------------------------------------


class InfillTimings(BaseModel):
    """Measured by the server around the generation (queueing included in prompt_ms)."""

    prompt_n: int = Field(description="prompt tokens computed (not restored from the cache)")
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class InfillResponse(BaseModel):
    """The whole fill; streamed, the last chunk (its content then is empty)."""

    index: int = 0
    content: str
    stop: Literal[True] = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int = Field(description="prompt tokens")
    tokens_cached: int = Field(description="prompt tokens restored from the prompt cache")
    truncated: bool = Field(
        False,
        description="whether the prompt was cut to fit the context (other files first, then "
        "the prefix's start and the suffix's end)",
    )
    stop_type: Literal["eos", "limit", "word"] = Field(
        description="eos: the model ended the fill; limit: n_predict or the context; "
        "word: a stop word"
    )
    stopping_word: str = Field("", description="the stop word that ended it, if one did")
    timings: InfillTimings


class InfillChunk(BaseModel):
    """One streamed piece of the fill."""

    index: int = 0
    content: str
    stop: Literal[False] = False
