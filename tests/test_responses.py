"""The OpenAI Responses API (/v1/responses) end to end, with the official openai SDK.

Servers are real: an in-process uvicorn server whose tiny model carries the
real Qwen3 chat template and whose output is scripted (tests/scripted.py), and
`flashserve serve` subprocesses for the store across a restart. Clients are the
openai SDK (`responses.create`, `responses.stream`, `responses.parse`,
retrieve, delete) and httpx for the raw SSE.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from flashserve.server.openai.response_store import ResponseStore

from .conftest import Server, start_server, stop_server
from .scripted import FIXTURES, make_templated_model, script, scripted_server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "unit": {"type": "string", "enum": ["celsius", "kelvin"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
CLOCK = {
    "type": "function",
    "name": "get_time",
    "description": "Current time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, CLOCK]
PARIS = {"city": "Paris", "unit": "celsius"}
ASK = "What is the weather in Paris?"
THOUGHT = "\nThe user wants a sum. 2 + 2 = 4.\n"


def hermes_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_templated_model(tmp_path_factory.mktemp("responses") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Iterator[Server]:
    with scripted_server(qwen3_dir) as server:
        yield server


def create(server: Server, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_output_tokens", 96)
    kwargs.setdefault("input", ASK)
    return server.client().responses.create(model=server.model_id, **kwargs)


def stream(server: Server, **kwargs: Any) -> tuple[Any, list[Any]]:
    """Through the SDK's own accumulator: (final response, every event)."""
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_output_tokens", 96)
    kwargs.setdefault("input", ASK)
    with server.client().responses.stream(model=server.model_id, **kwargs) as events:
        seen = list(events)
        return events.get_final_response(), seen


def types(events: list[Any]) -> list[str]:
    """Event types with runs of the same delta collapsed to one."""
    out: list[str] = []
    for event in events:
        if not (event.type.endswith(".delta") and out and out[-1] == event.type):
            out.append(event.type)
    return out


def calls(response: Any) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in response.output if o.type == "function_call"]


def usage(response: Any) -> tuple[int, int, int, int]:
    u = response.usage
    return (
        u.input_tokens,
        u.output_tokens,
        u.total_tokens,
        u.output_tokens_details.reasoning_tokens,
    )


# -- text, calls, formats: created and streamed ------------------------------------------------


def test_text_created_and_streamed_agree(qwen3: Server) -> None:
    whole = create(qwen3, **script("Sunny and warm."))
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed" and whole.output_text == "Sunny and warm."
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert message.content[0].annotations == []
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.temperature == 0 and whole.tools == [] and whole.parallel_tool_calls is True

    final, events = stream(qwen3, **script("Sunny and warm."))
    assert final.output_text == whole.output_text and final.status == "completed"
    assert usage(final) == usage(whole)
    assert types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Sunny and warm."


def test_function_call_created_streamed_and_round_trip(qwen3: Server) -> None:
    text = hermes_call("get_weather", PARIS)
    whole = create(qwen3, tools=TOOLS, **script(text))
    assert calls(whole) == [("get_weather", PARIS)] and whole.output_text == ""
    [call] = whole.output
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed" and whole.status == "completed"

    final, events = stream(qwen3, tools=TOOLS, **script(text))
    assert calls(final) == calls(whole) and usage(final) == usage(whole)
    assert types(events)[2:-1] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    added = next(e for e in events if e.type == "response.output_item.added").item
    assert added.name == "get_weather" and added.arguments == ""
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(fragments)) == PARIS

    # The call and its output go back as items; the prompt is what Chat Completions
    # renders for the same conversation.
    history = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in whole.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
    ]
    answer = create(qwen3, input=history, tools=TOOLS, **script("It is 21 degrees."))
    assert answer.output_text == "It is 21 degrees." and not calls(answer)
    chat = qwen3.client().chat.completions.create(
        model=qwen3.model_id,
        messages=[
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'},
        ],
        tools=[
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in TOOLS
        ],
        max_tokens=4,
        **script("ok"),
    )
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "capital": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "sure": {"type": "boolean"},
    },
    "required": ["capital", "sure"],
    "additionalProperties": False,
}


class Answer(BaseModel):
    capital: Literal["Paris", "Rome", "Oslo"]
    sure: bool


def test_json_schema_text_format_is_enforced(qwen3: Server) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    whole = create(qwen3, text={"format": fmt})  # no script: the grammar alone shapes it
    answer = json.loads(whole.output_text)
    assert set(answer) == {"capital", "sure"} and answer["capital"] in ("Paris", "Rome", "Oslo")
    assert whole.text.format.type == "json_schema"
    final, _ = stream(qwen3, text={"format": fmt})
    assert final.output_text == whole.output_text and usage(final) == usage(whole)
    # The SDK's structured-output helper parses the same text into the model.
    parsed = qwen3.client().responses.parse(
        model=qwen3.model_id, input=ASK, temperature=0, max_output_tokens=96, text_format=Answer
    )
    assert parsed.output_parsed == Answer(**answer)
    loose = create(qwen3, text={"format": {"type": "json_object"}}, max_output_tokens=48)
    assert loose.output_text.startswith("{")


def test_reasoning_output_item(qwen3: Server) -> None:
    reply = f"<think>{THOUGHT}</think>\n\nThe answer is 4."
    whole = create(qwen3, input="What is 2 + 2?", **script(reply))
    reasoning, _ = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == [THOUGHT] and reasoning.summary == []
    assert whole.output_text == "The answer is 4."
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    final, events = stream(qwen3, input="What is 2 + 2?", **script(reply))
    assert final.output_text == whole.output_text and usage(final) == usage(whole)
    assert [c.text for c in final.output[0].content] == [THOUGHT]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == THOUGHT
    assert types(events)[2:8] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_reasoning_items_reach_the_template(qwen3: Server) -> None:
    """A reasoning item is the next assistant turn's reasoning_content: Qwen3 renders it in
    the turn of the current tool loop."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}
    thought = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "I need the time."}],
    }
    base = [{"role": "user", "content": "Time?"}]
    plain = create(qwen3, input=[*base, call, out], tools=TOOLS, **script("Noon."))
    thinking = create(qwen3, input=[*base, thought, call, out], tools=TOOLS, **script("Noon."))
    assert thinking.usage.input_tokens > plain.usage.input_tokens


def test_tool_choice_required_named_and_parallel_false(qwen3: Server) -> None:
    # No script: the random model calls a tool only because the grammar makes it.
    free = create(qwen3, tools=TOOLS, max_output_tokens=24)
    assert not calls(free)
    one = create(qwen3, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(calls(one)) == 1 and one.parallel_tool_calls is False
    assert calls(one)[0][0] in ("get_weather", "get_time")
    named = {"type": "function", "name": "get_time"}
    chosen = create(qwen3, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    [(name, args)] = calls(chosen)
    assert name == "get_time" and args["zone"] in ("UTC", "CET")
    final, _ = stream(qwen3, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    assert calls(final) == calls(chosen)


def test_max_output_tokens_makes_an_incomplete_response(qwen3: Server) -> None:
    long = "one two three four five six seven eight nine ten eleven twelve"
    cut = create(qwen3, max_output_tokens=4, **script(long))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 4 and cut.output[0].status == "incomplete"
    assert long.startswith(cut.output_text) and cut.output_text
    client = qwen3.client()
    events = list(
        client.responses.create(
            model=qwen3.model_id,
            input=ASK,
            max_output_tokens=4,
            temperature=0,
            stream=True,
            **script(long),
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == cut.output_text
    assert "response.completed" not in types(events)


def test_reasoning_effort_minimal_turns_thinking_off(qwen3: Server) -> None:
    default = create(qwen3, reasoning={"effort": "medium", "summary": "auto"}, **script("4."))
    minimal = create(qwen3, reasoning={"effort": "minimal"}, **script("4."))
    # Qwen3's template reads enable_thinking: off, it writes an empty think block.
    assert minimal.usage.input_tokens > default.usage.input_tokens
    assert minimal.reasoning.effort == "minimal" and default.reasoning.summary == "auto"


def test_a_call_dropped_after_its_first_fragments(qwen3: Server) -> None:
    """A call announced while streaming that turns out malformed: its item got
    output_item.added and argument deltas, never a done event, and it is in neither
    response's output."""
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    whole = create(qwen3, tools=TOOLS, **script(bad))
    final, events = stream(qwen3, tools=TOOLS, **script(bad))
    assert not calls(whole) and not calls(final) and final.status == whole.status == "completed"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    assert any(e.type == "response.function_call_arguments.delta" for e in events)
    done = {e.type for e in events} & {
        "response.function_call_arguments.done",
        "response.output_item.done",
    }
    assert not done


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(qwen3: Server) -> None:
    recursive = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}
    fmt = {"format": {"type": "json_schema", "name": "r", "schema": recursive}}
    body = {"model": qwen3.model_id, "input": "hi", "max_output_tokens": 32, "text": fmt}
    http = qwen3.http()
    whole = http.post("/v1/responses", json=body)
    assert whole.status_code == 400 and whole.json()["error"]["param"] == "text.format"
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        events = sse_events(response)
    assert [name for name, _ in events][-2:] == ["error", "response.failed"]
    error, failed = events[-2][1], events[-1][1]["response"]
    assert error["param"] == "text.format" and "Cannot enforce" in error["message"]
    assert failed["status"] == "failed" and failed["error"]["message"] == error["message"]


# -- raw SSE and the Codex CLI request -------------------------------------------------------


def sse_events(response: Any) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a streamed httpx response."""
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            out.append((name, json.loads(line.split(":", 1)[1])))
    return out


def test_codex_request_is_answered(qwen3: Server) -> None:
    body = json.loads((FIXTURES / "codex_request.json").read_text())
    body["model"] = qwen3.model_id
    reply = "<think>I will read the README.</think>\n" + hermes_call(
        "shell", {"command": ["bash", "-lc", "cat README.md"], "workdir": "/home/user/project"}
    )
    headers = script(reply)["extra_headers"]
    with qwen3.http().stream("POST", "/v1/responses", json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    names = [name for name, _ in events]
    assert names == [data["type"] for _, data in events]  # `event:` names the data's type
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    collapsed = [n for i, n in enumerate(names) if not (n.endswith(".delta") and names[i - 1] == n)]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert done[0]["content"] == [{"type": "reasoning_text", "text": "I will read the README."}]
    assert done[1]["name"] == "shell" and json.loads(done[1]["arguments"])["command"][-1] == (
        "cat README.md"
    )
    completed = events[-1][1]["response"]
    assert completed["store"] is False and completed["parallel_tool_calls"] is False
    assert completed["usage"]["input_tokens"] > 0
    # store: false: nothing to retrieve.
    assert qwen3.http().get(f"/v1/responses/{completed['id']}").status_code == 404


# -- errors ---------------------------------------------------------------------------------


def test_bad_requests_are_400_error_objects_naming_the_item(qwen3: Server) -> None:
    http = qwen3.http()
    user = {"role": "user", "content": "hi"}
    deep = '{"a": ' * 5000 + "1" + "}" * 5000  # past json's recursion: a 400, not a 500
    cases = [
        (
            {"input": [user, {"type": "function_call_output", "call_id": "nope", "output": "x"}]},
            "input[1].call_id",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {
                "input": [
                    user,
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"},
                ]
            },
            "input[1].arguments",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {
                "input": [
                    user,
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": deep},
                ]
            },
            "input[1].arguments",
        ),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        (
            {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
            "tool_choice",
        ),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "hi", "background": True}, "background"),
        ({}, "input"),
        ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ]
    for extra, param in cases:
        response = http.post("/v1/responses", json={"model": qwen3.model_id, **extra})
        status = 404 if param == "previous_response_id" else 400
        assert response.status_code == status, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (extra, error)
        assert error["type"] == "invalid_request_error" and error["message"]
    # Echoed fields holding text UTF-8 cannot encode: a 400, not a response that fails.
    for field in ("user", "previous_response_id"):
        raw = json.dumps({"model": qwen3.model_id, "input": "hi", field: "\ud800"})
        response = http.post(
            "/v1/responses", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_other_tool_types_are_accepted_and_not_offered(qwen3: Server) -> None:
    extra = [
        {"type": "web_search"},
        {"type": "local_shell"},
        {"type": "custom", "name": "apply_patch"},
    ]
    plain = create(qwen3, tools=[CLOCK], **script("Hi."))
    mixed = create(qwen3, tools=[CLOCK, *extra], **script("Hi."))
    assert mixed.output_text == "Hi."
    assert mixed.usage.input_tokens == plain.usage.input_tokens  # only CLOCK is shown
    assert [t.type for t in mixed.tools] == ["function", "web_search", "local_shell", "custom"]


# -- the store: previous_response_id across a restart, retrieve, delete ------------------------


def test_previous_response_id_survives_a_restart(
    qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("responses-store")
    data = ["--data-dir", str(workdir / "data")]
    server = start_server(qwen3_dir, workdir, *data)
    try:
        first = server.client().responses.create(
            model=server.model_id,
            instructions="Answer in one word.",
            input="Remember the number seven.",
            max_output_tokens=6,
            temperature=0,
            metadata={"turn": "1"},
        )
    finally:
        stop_server(server)
    assert first.store is True and first.instructions == "Answer in one word."
    server = start_server(qwen3_dir, workdir, *data)
    try:
        client = server.client()
        again = client.responses.retrieve(first.id)
        assert again.model_dump() == first.model_dump()
        second = client.responses.create(
            model=server.model_id,
            previous_response_id=first.id,
            input="Which number?",
            max_output_tokens=4,
            temperature=0,
        )
        assert second.previous_response_id == first.id and second.instructions is None
        # The prompt is the stored conversation (without the old instructions) + the input.
        chat = client.chat.completions.create(
            model=server.model_id,
            messages=[
                {"role": "user", "content": "Remember the number seven."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Which number?"},
            ],
            max_tokens=1,
        )
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        third = client.responses.create(
            model=server.model_id, previous_response_id=second.id, input="And?", max_output_tokens=2
        )
        assert third.usage.input_tokens > second.usage.input_tokens

        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        raw = server.http().delete(f"/v1/responses/{first.id}")
        assert raw.status_code == 404 and raw.json()["error"]["code"] == "not_found"
        ok = server.http().delete(f"/v1/responses/{second.id}")
        assert ok.json() == {"id": second.id, "object": "response.deleted", "deleted": True}
        # The chain lives in each response: the third still continues after the second went.
        fourth = client.responses.create(
            model=server.model_id,
            previous_response_id=third.id,
            input="Go on.",
            max_output_tokens=2,
        )
        assert fourth.usage.input_tokens > third.usage.input_tokens
        # input may be left out where previous_response_id continues (the schema says so).
        fifth = client.responses.create(
            model=server.model_id, previous_response_id=fourth.id, max_output_tokens=2
        )
        assert fifth.usage.input_tokens > fourth.usage.input_tokens
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(
                model=server.model_id, previous_response_id=first.id, input="Hello?"
            )
        assert missing.value.body["param"] == "previous_response_id"
    finally:
        stop_server(server)
    assert "Traceback" not in server.log_tail(10**7), server.log_tail()


def test_store_is_bounded_and_can_be_off(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "data", max_rows=2)
    for n in range(3):
        asyncio.run(store.put({"id": f"resp_{n}"}, [{"n": n}]))
    assert asyncio.run(store.get("resp_0")) is None  # the oldest went first
    kept = asyncio.run(store.get("resp_2"))
    assert kept is not None and kept.conversation == [{"n": 2}]
    store.close()
    off = ResponseStore(tmp_path / "off", max_rows=0)
    asyncio.run(off.put({"id": "resp_x"}, []))
    assert asyncio.run(off.get("resp_x")) is None and not (tmp_path / "off").exists()
