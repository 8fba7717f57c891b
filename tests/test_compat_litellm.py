"""litellm's `completion`, used as its documentation shows for an OpenAI-compatible
server (`model="openai/<id>"`, `api_base`; setup: tests/compat.py).

Chat, `stream=True`, tools with the documented round trip (the response
message appended, then a tool message), `response_format` given a nested
pydantic model, and a named `tool_choice`.

litellm fetches its model price list from GitHub at import unless told to use
the copy it ships: the variable is set before the import, so nothing here
waits on the network.
"""

from __future__ import annotations

import os

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

import json
from collections.abc import Iterator
from typing import Any

import litellm
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
from .scripted import ScriptQueue, script_queue

litellm.telemetry = False

WEATHER_TOOL = {
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
    with compat_server(tmp_path_factory.mktemp("compat-litellm")) as server:
        yield server


def complete(server: Server, queue: ScriptQueue, messages: list[Any], **kwargs: Any) -> Any:
    return litellm.completion(
        model="openai/" + server.model_id,
        api_base=server.url + "/v1",
        api_key="unused",
        messages=messages,
        extra_headers=queue.headers,
        num_retries=0,
        timeout=60,
        **kwargs,
    )


def test_completion_and_stream(server: Server) -> None:
    queue = script_queue(ANSWER, ANSWER)
    response = complete(server, queue, [{"role": "user", "content": "Hi"}])
    assert response.choices[0].message.content == ANSWER
    assert response.choices[0].finish_reason == "stop"
    chunks = list(complete(server, queue, [{"role": "user", "content": "Hi"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER


def test_tool_round_trip(server: Server) -> None:
    queue = script_queue(WEATHER_CALL, FINAL)
    messages: list[Any] = list(ASK)
    response = complete(server, queue, messages, tools=[WEATHER_TOOL])
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        WEATHER_ARGS,
    )
    assert_no_markup(message.content or "")
    messages.append(message)
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": WEATHER_RESULT}
    )
    final = complete(server, queue, messages, tools=[WEATHER_TOOL])
    assert final.choices[0].message.content == FINAL
    assert_round_trip_history(queue.bodies[1], "get_weather", WEATHER_ARGS, WEATHER_RESULT)


def test_response_format_with_a_nested_model(server: Server) -> None:
    queue = script_queue(PARIS_JSON)
    response = complete(
        server,
        queue,
        [{"role": "user", "content": "Which city is the capital of France?"}],
        response_format=City,
    )
    assert City.model_validate_json(response.choices[0].message.content) == PARIS
    assert queue.bodies[0]["response_format"]["type"] == "json_schema"


def test_named_tool_choice(server: Server) -> None:
    queue = script_queue(WEATHER_CALL, tool_call("record_city", PARIS.model_dump()))
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = complete(server, queue, ASK, tools=[WEATHER_TOOL], tool_choice=named)
    (call,) = response.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == WEATHER_ARGS
    assert queue.bodies[0]["tool_choice"] == named
    # A nested model's schema ($defs/$ref) as the forced tool, streamed: litellm's
    # chunk builder puts the call back together.
    city_tool = {
        "type": "function",
        "function": {"name": "record_city", "parameters": City.model_json_schema()},
    }
    named = {"type": "function", "function": {"name": "record_city"}}
    chunks = list(complete(server, queue, ASK, tools=[city_tool], tool_choice=named, stream=True))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ASK)
    (call,) = rebuilt.choices[0].message.tool_calls
    assert City.model_validate_json(call.function.arguments) == PARIS
    assert rebuilt.choices[0].finish_reason == "tool_calls"
    assert_no_markup(rebuilt.choices[0].message.content or "")
    assert "$defs" in json.dumps(queue.bodies[1]["tools"])
