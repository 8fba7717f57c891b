"""instructor over the openai SDK, used as its documentation shows (setup: tests/compat.py).

`instructor.from_openai(client, mode=...)`: plain completions
(`response_model=None`, streamed too), `Mode.TOOLS` (its default and forced
mode: `tool_choice` names the model's tool), `Mode.JSON_SCHEMA` (a
`response_format`), `create_partial` streaming, and the validation retry,
which is instructor's tool round trip: the failed call goes back as the
assistant's `tool_calls` with a tool message carrying the error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import instructor
import openai
import pytest
from pydantic import field_validator

from .compat import (
    ANSWER,
    PARIS,
    PARIS_JSON,
    City,
    assert_no_markup,
    assert_round_trip_history,
    compat_server,
    tool_call,
)
from .conftest import Server
from .scripted import ScriptQueue, script_queue

ASK = [{"role": "user", "content": "Which city is the capital of France?"}]


class CapitalCity(City):
    """City whose name must be capitalised: a validator instructor retries on."""

    @field_validator("name")
    @classmethod
    def capitalised(cls, name: str) -> str:
        if not name[:1].isupper():
            raise ValueError("the name must start with a capital letter")
        return name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with compat_server(tmp_path_factory.mktemp("compat-instructor")) as server:
        yield server


def patched(server: Server, queue: ScriptQueue, mode: instructor.Mode) -> instructor.Instructor:
    client = openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, default_headers=queue.headers
    )
    return instructor.from_openai(client, mode=mode)


def test_plain_completion_and_stream(server: Server) -> None:
    client = patched(server, script_queue(ANSWER, ANSWER), instructor.Mode.TOOLS)
    completion = client.chat.completions.create(
        model=server.model_id, messages=ASK, response_model=None
    )
    assert completion.choices[0].message.content == ANSWER
    stream = client.chat.completions.create(
        model=server.model_id, messages=ASK, response_model=None, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ANSWER


def test_tools_mode_is_a_forced_call(server: Server) -> None:
    queue = script_queue(tool_call("City", PARIS.model_dump()))
    client = patched(server, queue, instructor.Mode.TOOLS)
    city = client.chat.completions.create(model=server.model_id, messages=ASK, response_model=City)
    assert isinstance(city, City) and city.model_dump() == PARIS.model_dump()
    body = queue.bodies[0]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    assert "$defs" in json.dumps(body["tools"][0]["function"]["parameters"])
    # Streamed: partial objects built from the call's argument deltas (the tool is
    # then named after instructor's Partial model).
    queue.push(tool_call("PartialCity", PARIS.model_dump()))
    partials = list(
        client.chat.completions.create_partial(
            model=server.model_id, messages=ASK, response_model=City
        )
    )
    assert partials[-1].model_dump() == PARIS.model_dump()
    assert queue.bodies[1]["stream"] is True
    assert queue.bodies[1]["tool_choice"]["function"]["name"] == "PartialCity"


def test_validation_retry_round_trip(server: Server) -> None:
    wrong = PARIS.model_copy(update={"name": "paris"})
    queue = script_queue(
        tool_call("CapitalCity", wrong.model_dump()), tool_call("CapitalCity", PARIS.model_dump())
    )
    client = patched(server, queue, instructor.Mode.TOOLS)
    city = client.chat.completions.create(
        model=server.model_id, messages=ASK, response_model=CapitalCity, max_retries=2
    )
    assert isinstance(city, CapitalCity) and city.model_dump() == PARIS.model_dump()
    assert len(queue.bodies) == 2
    assert_round_trip_history(
        queue.bodies[1],
        "CapitalCity",
        wrong.model_dump(),
        "the name must start with a capital letter",
    )


def test_json_schema_mode_and_partial_stream(server: Server) -> None:
    queue = script_queue(PARIS_JSON, PARIS_JSON)
    client = patched(server, queue, instructor.Mode.JSON_SCHEMA)
    city = client.chat.completions.create(model=server.model_id, messages=ASK, response_model=City)
    assert isinstance(city, City) and city.model_dump() == PARIS.model_dump()
    assert queue.bodies[0]["response_format"]["type"] == "json_schema"
    partials = list(
        client.chat.completions.create_partial(
            model=server.model_id, messages=ASK, response_model=City
        )
    )
    assert len(partials) > 1
    assert partials[-1].model_dump() == PARIS.model_dump()
    assert_no_markup(queue.bodies)
