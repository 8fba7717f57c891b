"""pydantic-ai's Agent on OpenAIChatModel, used as its documentation shows for an
OpenAI-compatible server (`OpenAIProvider`; setup: tests/compat.py).

`run_sync`, `run_stream_sync` with `stream_text`, a function tool (the agent
runs it and sends the result back), `NativeOutput` (a json_schema
`response_format`) and the default output mode, a tool the model is forced to
call (`tool_choice: required`), both with a nested model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

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
    get_weather,
    tool_call,
)
from .conftest import Server
from .scripted import ScriptQueue, script_queue


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with compat_server(tmp_path_factory.mktemp("compat-pydantic-ai")) as server:
        yield server


def chat_model(server: Server, queue: ScriptQueue) -> OpenAIChatModel:
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, default_headers=queue.headers
    )
    return OpenAIChatModel(server.model_id, provider=OpenAIProvider(openai_client=client))


def test_run_and_stream_text(server: Server) -> None:
    agent = Agent(chat_model(server, script_queue(ANSWER, ANSWER)))
    assert agent.run_sync("Hi").output == ANSWER
    with agent.run_stream_sync("Hi") as result:
        assert "".join(result.stream_text(delta=True)) == ANSWER


def test_tool_round_trip(server: Server) -> None:
    queue = script_queue(WEATHER_CALL, FINAL)
    agent = Agent(chat_model(server, queue), tools=[get_weather])
    result = agent.run_sync("What is the weather in Paris?")
    assert result.output == FINAL
    assert len(queue.bodies) == 2
    assert queue.bodies[0].get("tool_choice", "auto") == "auto"
    assert_round_trip_history(queue.bodies[1], "get_weather", WEATHER_ARGS, WEATHER_RESULT)


def test_native_output_with_a_nested_model(server: Server) -> None:
    queue = script_queue(PARIS_JSON, PARIS_JSON)
    agent = Agent(chat_model(server, queue), output_type=NativeOutput(City))
    assert agent.run_sync("Which city is the capital of France?").output == PARIS
    assert queue.bodies[0]["response_format"]["type"] == "json_schema"
    with agent.run_stream_sync("Which city is the capital of France?") as result:
        outputs = list(result.stream_output(debounce_by=None))
    assert outputs[-1] == PARIS


def test_tool_output_is_a_forced_call(server: Server) -> None:
    """The default output mode: an output tool, which the model must call."""
    call = tool_call("final_result", PARIS.model_dump())
    queue = script_queue(call, call)
    agent: Agent[None, Any] = Agent(chat_model(server, queue), output_type=City)
    assert agent.run_sync("Which city is the capital of France?").output == PARIS
    # Streamed: the output is validated from the call's argument deltas as they come.
    with agent.run_stream_sync("Which city is the capital of France?") as result:
        outputs = list(result.stream_output(debounce_by=None))
    assert outputs[-1] == PARIS
    body = queue.bodies[0]
    assert body["tool_choice"] == "required"
    (tool,) = body["tools"]
    assert tool["function"]["name"] == "final_result"
    assert "$defs" in json.dumps(tool["function"]["parameters"])
    assert_no_markup(body)
