"""The official `openai` SDK, used as its README shows (tests/compat.py has the setup).

Chat, streaming, a tool round trip, `chat.completions.parse` with a nested
pydantic model as `response_format`, and forced calls: a named `tool_choice`
and `pydantic_function_tool` with `parse` (strict tools, `$defs`/`$ref`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from .compat import (
    ANSWER,
    FINAL,
    PARIS,
    PARIS_JSON,
    WEATHER_ARGS,
    WEATHER_CALL,
    WEATHER_RESULT,
    City,
    assert_no_markup,
    assert_round_trip_history,
    compat_server,
    tool_call,
)
from .conftest import Server
from .scripted import script, script_queue

WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with compat_server(tmp_path_factory.mktemp("compat-openai")) as server:
        yield server


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_and_streaming(server: Server, client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "Hi"}], **script(ANSWER)
    )
    assert completion.choices[0].message.content == ANSWER
    assert completion.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
        stream_options={"include_usage": True},
        **script(ANSWER),
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens


def test_tool_round_trip(server: Server, client: openai.OpenAI) -> None:
    queue = script_queue(WEATHER_CALL, FINAL)
    messages: list[Any] = list(ASK)
    first = client.chat.completions.create(
        model=server.model_id, messages=messages, tools=[WEATHER_TOOL], extra_headers=queue.headers
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.content is None
    (call,) = message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        WEATHER_ARGS,
    )
    # The SDK's documented loop: the message goes back as is, then the tool's result.
    messages.append(message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT})
    second = client.chat.completions.create(
        model=server.model_id, messages=messages, tools=[WEATHER_TOOL], extra_headers=queue.headers
    )
    assert second.choices[0].message.content == FINAL
    assert second.choices[0].finish_reason == "stop"
    assert_round_trip_history(queue.bodies[1], "get_weather", WEATHER_ARGS, WEATHER_RESULT)


def test_parse_with_a_nested_model(server: Server, client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=server.model_id,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City,
        **script(PARIS_JSON),
    )
    assert completion.choices[0].message.parsed == PARIS
    # The streaming helper accumulates the same object.
    with client.chat.completions.stream(
        model=server.model_id,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City,
        **script(PARIS_JSON),
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == PARIS


def test_forced_tools(server: Server, client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model=server.model_id,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **script(WEATHER_CALL),
    )
    (call,) = named.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == WEATHER_ARGS
    assert named.choices[0].finish_reason == "tool_calls"
    # A strict pydantic tool (nested: $defs/$ref), forced by name, parsed by the SDK.
    tool = openai.pydantic_function_tool(City, name="record_city")
    for stream in (False, True):
        kwargs: dict[str, Any] = {
            "model": server.model_id,
            "messages": [{"role": "user", "content": "Record the capital of France."}],
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "record_city"}},
            **script(tool_call("record_city", PARIS.model_dump())),
        }
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                message = events.get_final_completion().choices[0].message
        else:
            message = client.chat.completions.parse(**kwargs).choices[0].message
        (parsed,) = message.tool_calls or []
        assert parsed.function.parsed_arguments == PARIS, stream
        assert_no_markup(message.content or "")
