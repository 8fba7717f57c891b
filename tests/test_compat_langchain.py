"""langchain-openai's ChatOpenAI, used as its documentation shows (setup: tests/compat.py).

`invoke` and `stream`, `bind_tools` with the documented tool loop (calls run
through the tool, ToolMessages back), `with_structured_output` with a nested
model (default method: a strict json_schema `response_format`), and the forced
modes: `bind_tools(tool_choice=...)` and `method="function_calling"`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import reduce

import pytest
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

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

weather_tool = tool(get_weather)
# langchain-openai dumps the SDK's parsed completion into its metadata (its own warning).
pytestmark = pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with compat_server(tmp_path_factory.mktemp("compat-langchain")) as server:
        yield server


def chat_model(server: Server, queue: ScriptQueue) -> ChatOpenAI:
    return ChatOpenAI(
        model=server.model_id,
        base_url=server.url + "/v1",
        api_key="unused",
        temperature=0,
        max_retries=0,
        default_headers=queue.headers,
    )


def test_invoke_and_stream(server: Server) -> None:
    llm = chat_model(server, script_queue(ANSWER, ANSWER))
    message = llm.invoke("Hi")
    assert message.content == ANSWER
    assert message.response_metadata["finish_reason"] == "stop"
    chunks = list(llm.stream("Hi"))
    assert "".join(str(c.content) for c in chunks) == ANSWER


def test_tool_round_trip(server: Server) -> None:
    queue = script_queue(WEATHER_CALL, FINAL, WEATHER_CALL)
    llm = chat_model(server, queue).bind_tools([weather_tool])
    messages: list[BaseMessage] = [HumanMessage("What is the weather in Paris?")]
    ai = llm.invoke(messages)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", WEATHER_ARGS)]
    assert not ai.content
    messages.append(ai)
    messages += [weather_tool.invoke(call) for call in ai.tool_calls]
    final = llm.invoke(messages)
    assert final.content == FINAL
    assert not final.tool_calls
    assert_round_trip_history(queue.bodies[1], "get_weather", WEATHER_ARGS, WEATHER_RESULT)
    # Streamed, the chunks add up to the same call.
    streamed = reduce(lambda a, b: a + b, llm.stream(messages[:1]))
    assert isinstance(streamed, AIMessageChunk)
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("get_weather", WEATHER_ARGS)]
    assert_no_markup(streamed.content)


def test_structured_output_with_a_nested_model(server: Server) -> None:
    queue = script_queue(PARIS_JSON, PARIS_JSON)
    structured = chat_model(server, queue).with_structured_output(City)
    assert structured.invoke("Which city is the capital of France?") == PARIS
    assert queue.bodies[0]["response_format"]["type"] == "json_schema"
    # Streaming a structured output ends with the whole object.
    *_, last = structured.stream("Which city is the capital of France?")
    assert last == PARIS


def test_forced_tools(server: Server) -> None:
    queue = script_queue(WEATHER_CALL, tool_call("City", PARIS.model_dump()))
    llm = chat_model(server, queue)
    forced = llm.bind_tools([weather_tool], tool_choice="get_weather")
    ai = forced.invoke("What is the weather in Paris?")
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", WEATHER_ARGS)]
    assert queue.bodies[0]["tool_choice"] == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    structured = llm.with_structured_output(City, method="function_calling")
    assert structured.invoke("Which city is the capital of France?") == PARIS
    assert queue.bodies[1]["tool_choice"]["function"]["name"] == "City"
    country = queue.bodies[1]["tools"][0]["function"]["parameters"]["properties"]["country"]
    assert country["properties"]["code"]["enum"] == ["FR", "IT", "NO"]  # nested, inlined
