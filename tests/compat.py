"""What the client-library compatibility tests share (tests/test_compat_*.py).

Each library is used the way its documentation shows, against a real server
whose tiny model carries Qwen3's chat template (Hermes-style calls:
`<tool_call>{json}</tool_call>`). The model's output is scripted (see
tests/scripted.py): libraries that make several requests from one client get
a ScriptQueue, one script per request, sent as a fixed default header, and the
queue keeps the request bodies, so a test reads the history a library sent.
Structured output and forced calls also go through the server's grammar, so
every scripted JSON text below satisfies its schema.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from .conftest import Server
from .scripted import make_templated_model, scripted_server

MARKUP = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<|im_start|>", "<|im_end|>")


class Country(BaseModel):
    name: str
    code: Literal["FR", "IT", "NO"]


class City(BaseModel):
    """A model holding another model: pydantic writes Country under $defs, as a $ref."""

    name: str
    country: Country


PARIS = City(name="Paris", country=Country(name="France", code="FR"))
# Key order and separators as pydantic and json.dumps write them; the grammar allows both.
PARIS_JSON = json.dumps(PARIS.model_dump())

ANSWER = "Hello from flashserve."
WEATHER_ARGS = {"city": "Paris"}
FINAL = "It is 21 degrees and sunny in Paris."
WEATHER_RESULT = "21 degrees, sunny"


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return WEATHER_RESULT if city == "Paris" else "unknown"


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The model's text for one call, exactly as Qwen3's template writes calls."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


WEATHER_CALL = tool_call("get_weather", WEATHER_ARGS)


@contextlib.contextmanager
def compat_server(root: Path) -> Iterator[Server]:
    """A scripted server on a tiny model with Qwen3's template, under `root`."""
    model = make_templated_model(root / "tiny-qwen3", "qwen3")
    with scripted_server(model) as server:
        yield server


def assert_no_markup(value: Any) -> None:
    """No template or call markup anywhere in `value` (a body, a message, a text)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    for marker in MARKUP:
        assert marker not in text, (marker, text)


def assert_round_trip_history(
    body: dict[str, Any], name: str, arguments: dict[str, Any], result: str
) -> None:
    """The request after a call carries the call as `tool_calls` (no text) and its result.

    What the history must hold however a library spells it: the assistant turn with
    the one call and its exact arguments, then a tool message answering its id.
    """
    assert_no_markup(body)
    messages = body["messages"]
    turns = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    assert len(turns) == 1, messages
    assistant = turns[0]
    assert not assistant.get("content"), assistant
    (call,) = assistant["tool_calls"]
    assert call["function"]["name"] == name
    assert json.loads(call["function"]["arguments"]) == arguments
    replies = [m for m in messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in replies] == [call["id"]], messages
    assert result in json.dumps(replies[0]["content"]), replies
    assert messages.index(assistant) < messages.index(replies[0])
