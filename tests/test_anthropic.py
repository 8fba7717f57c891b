"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) end to end.

A real uvicorn server in this process (so the tiny model's output can be
scripted, see tests/scripted.py) whose tiny model carries the real Qwen3 chat
template, with an API key, a body limit and a CORS origin; its context is
16k tokens, so Claude Code's max_tokens 32000 must be clamped, not refused.
Clients: the official anthropic SDK, and httpx for the raw SSE stream.
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI

from flashserve.engine.generation.worker import EngineNotReadyError, QueueFullError
from flashserve.engine.weights.synthetic import make_model_dir
from flashserve.server.anthropic.messages import sse
from flashserve.server.anthropic.protocol import MessagesRequest, PingEvent
from flashserve.server.anthropic.translate import template_messages
from flashserve.server.http.errors import APIError, install_error_handlers
from flashserve.server.http.middleware import install_middleware

from .conftest import Server, serve_app
from .scripted import FIXTURES, SCRIPT_HEADER, TEMPLATES, script, scripted_server

KEY = "test-key"
ORIGIN = "http://localhost:5173"
BODY_LIMIT = 65536
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = {"city": "Paris", "unit": "celsius"}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "unit": {"type": "string", "enum": ["celsius", "kelvin"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "get_time",
    "description": "Current time in a time zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, CLOCK]


def hermes_call(name: str, args: dict) -> str:
    """A call as Qwen3 writes it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    spec = dict(TEMPLATES["qwen3"])
    spec["chat_template"] = (FIXTURES / spec["chat_template"]).read_text()
    path = make_model_dir(
        tmp_path_factory.mktemp("anthropic") / "tiny-qwen3",
        "llama",
        overrides={"max_position_embeddings": 16384},
        **spec,
    )
    with scripted_server(
        path, api_key=KEY, max_body_bytes=BODY_LIMIT, allowed_origins=[ORIGIN]
    ) as running:
        yield running


def client(server: Server, **kwargs: Any) -> anthropic.Anthropic:
    """The official SDK without retries; the key goes in x-api-key."""
    if "auth_token" not in kwargs:
        kwargs.setdefault("api_key", KEY)
    # An explicit timeout: the SDK refuses non-streaming calls with a large max_tokens otherwise.
    made = anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120.0, **kwargs)
    server._clients.append(made)
    return made


def greedy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """max_tokens 96 and temperature 0 unless given. SDK 2.x has no temperature
    argument any more (Anthropic's newest models take none); the API still reads
    it, and so does this server, so it goes in the body."""
    kwargs.setdefault("max_tokens", 96)
    kwargs.setdefault("extra_body", {"temperature": 0})
    return kwargs


def ask(server: Server, text: str | None = None, messages: list = ASK, **kwargs: Any) -> Any:
    extra = script(text) if text is not None else {}
    return client(server).messages.create(
        model=server.model_id, messages=messages, **extra, **greedy(kwargs)
    )


def ask_streaming(
    server: Server, text: str, messages: list = ASK, **kwargs: Any
) -> tuple[Any, list[Any]]:
    """Stream through the SDK's accumulator; return (final message, events)."""
    with client(server).messages.stream(
        model=server.model_id, messages=messages, **script(text), **greedy(kwargs)
    ) as stream:
        events = list(stream)
        return stream.get_final_message(), events


def count(server: Server, messages: list = ASK, **kwargs: Any) -> int:
    return (
        client(server)
        .messages.count_tokens(model=server.model_id, messages=messages, **kwargs)
        .input_tokens
    )


def raw_stream(server: Server, body: dict, text: str) -> tuple[httpx.Response, list[tuple]]:
    """POST a streaming body with httpx; return the response and its (event, data) pairs."""
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", SCRIPT_HEADER: json.dumps(text)}
    events: list[tuple[str, dict]] = []
    with server.http().stream("POST", "/v1/messages", json=body, headers=headers) as response:
        name = None
        for line in response.iter_lines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line.removeprefix("data:"))))
    return response, events


def blocks(message: Any) -> list[dict]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def usage(message: Any) -> tuple[int, int, int]:
    u = message.usage
    return (u.input_tokens, u.output_tokens, u.cache_read_input_tokens)


# -- text -------------------------------------------------------------------------------


def test_create_stream_and_count_tokens_agree(server: Server) -> None:
    text = "Mild and sunny, about 18 degrees."
    message = ask(server, text)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.model == server.model_id and message.role == "assistant"
    assert blocks(message) == [{"type": "text", "text": text}]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    final, _ = ask_streaming(server, text)
    assert blocks(final) == blocks(message)
    assert final.stop_reason == message.stop_reason
    assert usage(final) == usage(message)
    assert message.usage.output_tokens > 0
    # count_tokens renders the prompt as /v1/messages does (the prompt cache is off).
    assert count(server) == message.usage.input_tokens > 0


def test_raw_event_stream_order(server: Server) -> None:
    """message_start, ping, then each block opened, filled and closed (a thinking block
    ends with its signature), message_delta, message_stop; `event:` names the type."""
    body = {"model": server.model_id, "max_tokens": 64, "messages": ASK, "stream": True}
    response, events = raw_stream(server, body, "<think>Warm season.</think>Sunny.")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    squeezed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert squeezed == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    starts = [d for n, d in events if n == "content_block_start"]
    assert [(d["index"], d["content_block"]["type"]) for d in starts] == [
        (0, "thinking"),
        (1, "text"),
    ]
    deltas = [d for n, d in events if n == "content_block_delta"]
    thinking = [d["delta"] for d in deltas if d["index"] == 0]
    assert "".join(d.get("thinking", "") for d in thinking) == "Warm season."
    assert thinking[-1]["type"] == "signature_delta" and thinking[-1]["signature"]
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 1) == "Sunny."
    end = next(d for n, d in events if n == "message_delta")
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] > 0


def test_stop_sequence_and_max_tokens(server: Server) -> None:
    message = ask(server, "Hello END there", stop_sequences=["XYZ", "END"])
    assert blocks(message) == [{"type": "text", "text": "Hello "}]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")
    final, _ = ask_streaming(server, "Hello END there", stop_sequences=["XYZ", "END"])
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    assert blocks(final) == blocks(message)
    cut = ask(server, "One two three four five six", max_tokens=3)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)


# -- tools ------------------------------------------------------------------------------


def test_streamed_tool_use_arrives_as_input_json_deltas(server: Server) -> None:
    args = {"city": "Paris", "unit": "celsius"}
    text = "Let me check.\n" + hermes_call("get_weather", args)
    message = ask(server, text, tools=TOOLS)
    final, events = ask_streaming(server, text, tools=TOOLS)
    for result in (message, final):
        assert [b.type for b in result.content] == ["text", "tool_use"]
        assert result.content[0].text == "Let me check."
        call = result.content[1]
        assert (call.name, call.input) == ("get_weather", args)
        assert call.id.startswith("toolu_")
        assert result.stop_reason == "tool_use"
    assert blocks(final)[0] == blocks(message)[0]
    assert usage(final) == usage(message)
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(fragments) > 1, fragments
    assert json.loads("".join(fragments)) == args
    start = next(e for e in events if e.type == "content_block_start" and e.index == 1)
    assert (start.content_block.type, start.content_block.input) == ("tool_use", {})


def test_a_streamed_call_that_turns_out_malformed(server: Server) -> None:
    """Announced (its name was complete), then malformed: the stream has sent the
    tool_use block and its input so far, and closes it; the message ends end_turn.
    The non-streamed message leaves the call out."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    message = ask(server, text, tools=TOOLS)
    assert (blocks(message), message.stop_reason) == ([], "end_turn")
    body = {"model": server.model_id, "max_tokens": 96, "messages": ASK, "tools": TOOLS}
    _, events = raw_stream(server, {**body, "stream": True}, text)
    started = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b["name"]) for b in started] == [("tool_use", "get_weather")]
    sent = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert sent.startswith('{"city": ')  # as far as the arguments went
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0]
    end = next(d for n, d in events if n == "message_delta")
    assert end["delta"]["stop_reason"] == "end_turn"


def test_tool_round_trip(server: Server) -> None:
    first = ask(server, hermes_call("get_weather", PARIS), tools=TOOLS)
    call = first.content[-1]
    assert call.type == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny"}
    history = [
        *ASK,
        {"role": "assistant", "content": blocks(first)},
        {"role": "user", "content": [result]},
    ]
    answer = ask(server, "It is 18 degrees and sunny.", messages=history, tools=TOOLS)
    assert blocks(answer) == [{"type": "text", "text": "It is 18 degrees and sunny."}]
    assert answer.stop_reason == "end_turn"
    # The result reaches the prompt, marked when it is an error.
    longer = [*history[:2], {"role": "user", "content": [{**result, "content": "18 degrees"}]}]
    failed = [*history[:2], {"role": "user", "content": [{**result, "is_error": True}]}]
    assert count(server, longer, tools=TOOLS) < count(server, history, tools=TOOLS)
    assert count(server, failed, tools=TOOLS) > count(server, history, tools=TOOLS)


def test_translation_into_the_chat_template_shape() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "x"}}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": PARIS,
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "no data"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        }
    )
    assert template_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(PARIS)},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "toolu_1",
            "name": "get_weather",
            "content": "Error: no data",
        },
        {"role": "user", "content": "And tomorrow?"},
    ]


def test_tool_choice_any_tool_and_disable_parallel_tool_use(server: Server) -> None:
    """Enforced by constrained decoding: no script, the random model must call."""
    free = ask(server, tools=TOOLS, max_tokens=24)
    assert not any(b.type == "tool_use" for b in free.content)
    single = ask(
        server, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}
    )
    calls = [b for b in single.content if b.type == "tool_use"]
    assert single.stop_reason == "tool_use" and len(calls) == 1
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[calls[0].name]
    properties = tool["input_schema"]["properties"]
    assert all(calls[0].input[k] in properties[k]["enum"] for k in properties)
    named = ask(server, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    assert named.content[-1].input["zone"] in ("UTC", "CET")
    # none: the tools are not offered at all.
    assert count(server, tools=TOOLS, tool_choice={"type": "none"}) == count(server)


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "capital": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "sure": {"type": "boolean"},
    },
    "required": ["capital", "sure"],
    "additionalProperties": False,
}


def test_structured_output_is_enforced(server: Server) -> None:
    """output_config.format (and the beta's output_format): no script, the random
    model must still answer in the schema."""
    fmt = {"type": "json_schema", "schema": ANSWER_SCHEMA}
    message = ask(server, output_config={"format": fmt})
    answer = json.loads(message.content[0].text)
    assert set(answer) == {"capital", "sure"} and answer["capital"] in ("Paris", "Rome", "Oslo")
    assert message.stop_reason == "end_turn"
    beta = ask(server, extra_body={"temperature": 0, "output_format": fmt})
    assert blocks(beta) == blocks(message)


def test_server_tools_are_left_out(server: Server) -> None:
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    assert count(server, tools=[*TOOLS, search]) == count(server, tools=TOOLS)
    assert ask(server, "Fine.", tools=[*TOOLS, search]).content[0].text == "Fine."
    with pytest.raises(anthropic.BadRequestError, match="web_search"):
        ask(server, tools=[*TOOLS, search], tool_choice={"type": "tool", "name": "web_search"})


# -- thinking ---------------------------------------------------------------------------


def test_thinking_blocks_out_and_in(server: Server) -> None:
    text = "<think>Paris is in France.</think>It is mild."
    message = ask(server, text)
    final, _ = ask_streaming(server, text)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Paris is in France."
    assert isinstance(message.content[0].signature, str) and message.content[0].signature
    assert message.content[1].text == "It is mild."
    assert blocks(final) == blocks(message)
    # In: past thinking goes into the prompt (Qwen3 shows it within a tool loop).
    call = {"type": "tool_use", "id": "toolu_9", "name": "get_weather", "input": PARIS}
    thought = {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}
    plain = [*ASK, {"role": "assistant", "content": [call]}, result]
    thoughtful = [*ASK, {"role": "assistant", "content": [thought, call]}, result]
    assert count(server, thoughtful, tools=TOOLS) > count(server, plain, tools=TOOLS)
    # `thinking` maps to the template's enable_thinking (Qwen3: off adds an empty block).
    default = count(server)
    enabled = count(server, thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled == default < count(server, thinking={"type": "disabled"})


# -- Claude Code --------------------------------------------------------------------------


def test_claude_code_request_is_answered(server: Server) -> None:
    """Claude Code's shape: system blocks with cache_control, tools, metadata,
    max_tokens 32000 (beyond this model's context: clamped), stream, a tool exchange."""
    body = json.loads((FIXTURES / "claude_code_request.json").read_text())
    body["model"] = server.model_id  # what ANTHROPIC_MODEL names
    text = "Two entries matter.\n" + hermes_call("Read", {"file_path": "/home/user/README.md"})
    response, events = raw_stream(server, body, text)
    assert response.status_code == 200
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    tool_start = next(d for n, d in events if n == "content_block_start" and d["index"] == 1)
    assert tool_start["content_block"]["name"] == "Read"
    arguments = "".join(
        d["delta"]["partial_json"]
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    )
    assert json.loads(arguments) == {"file_path": "/home/user/README.md"}
    end = next(d for n, d in events if n == "message_delta")
    assert end["delta"]["stop_reason"] == "tool_use"
    counted = server.http().post(
        "/v1/messages/count_tokens",
        json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")},
        headers={"x-api-key": KEY},
    )
    assert counted.json() == {"input_tokens": end["usage"]["input_tokens"]}


# -- errors ------------------------------------------------------------------------------


def assert_anthropic_error(exc: anthropic.APIStatusError, kind: str, text: str) -> None:
    assert exc.body == {"type": "error", "error": {"type": kind, "message": exc.api_message}}
    assert text in (exc.api_message or "")


def test_invalid_requests_are_anthropic_errors(server: Server) -> None:
    sdk = client(server)
    with pytest.raises(anthropic.BadRequestError) as missing:
        sdk.post("/v1/messages", body={"model": server.model_id, "messages": ASK}, cast_to=object)
    assert_anthropic_error(missing.value, "invalid_request_error", "'max_tokens' is required")
    with pytest.raises(anthropic.BadRequestError) as role:
        ask(server, messages=[{"role": "developer", "content": "hi"}])
    assert_anthropic_error(role.value, "invalid_request_error", "messages.0.role")
    with pytest.raises(anthropic.NotFoundError) as model:
        sdk.messages.create(model="claude-opus-4", max_tokens=5, messages=ASK)
    assert_anthropic_error(model.value, "not_found_error", "'claude-opus-4' does not exist")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as media:
        ask(server, messages=[{"role": "user", "content": [image]}])
    assert_anthropic_error(media.value, "invalid_request_error", "accepts text only")
    prefill = [*ASK, {"role": "assistant", "content": "The weather is"}]
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        ask(server, messages=prefill)
    with pytest.raises(anthropic.RequestTooLargeError) as large:
        ask(server, messages=[{"role": "user", "content": "x" * BODY_LIMIT}])
    assert_anthropic_error(large.value, "request_too_large", "max_body_bytes")
    # The OpenAI routes keep their own shape.
    openai_shape = server.http().post("/v1/chat/completions", json={}, headers={"x-api-key": KEY})
    assert openai_shape.status_code == 400 and "type" not in openai_shape.json()


def test_api_key_in_x_api_key_or_bearer(server: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        client(server, api_key="wrong").messages.count_tokens(model=server.model_id, messages=ASK)
    assert_anthropic_error(wrong.value, "authentication_error", "Incorrect API key")
    assert KEY not in str(wrong.value.body)
    assert wrong.value.request_id  # Anthropic's request-id header
    bearer = client(server, auth_token=KEY, api_key=None)
    assert bearer.messages.count_tokens(model=server.model_id, messages=ASK).input_tokens > 0
    missing = server.http().post("/v1/messages/count_tokens", json={})
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    # Browsers may send Anthropic's headers cross-origin.
    preflight = server.http().options(
        "/v1/messages",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-api-key,anthropic-version,anthropic-beta",
        },
    )
    assert preflight.status_code == 200
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert all(h in allowed for h in ("x-api-key", "anthropic-version", "anthropic-beta"))


def test_server_side_failures_are_anthropic_errors() -> None:
    """Queue full, not ready and a bug, through the app's real handlers and middleware."""
    app = FastAPI()
    app.state.engine = types.SimpleNamespace(state="loading", load_error=None)
    install_error_handlers(app)

    @app.post("/v1/messages")
    async def full() -> None:
        raise QueueFullError("64 waiting")

    @app.post("/v1/messages/count_tokens")
    async def loading() -> None:
        raise EngineNotReadyError()

    @app.post("/v1/messages/bug")
    async def bug() -> None:
        raise RuntimeError("boom")

    install_middleware(
        app,
        metrics=None,
        api_key=None,
        allowed_origins=[],
        allowed_hosts=["*"],
        max_body_bytes=BODY_LIMIT,
        log_prompts=False,
    )
    with serve_app(app) as running:
        sdk = client(running)
        with pytest.raises(anthropic.RateLimitError) as full_exc:
            sdk.messages.create(model="m", max_tokens=5, messages=ASK)
        assert_anthropic_error(full_exc.value, "rate_limit_error", "busy")
        with pytest.raises(anthropic.InternalServerError) as ready_exc:
            sdk.messages.count_tokens(model="m", messages=ASK)
        assert ready_exc.value.status_code == 503
        assert_anthropic_error(ready_exc.value, "overloaded_error", "still loading")
        with pytest.raises(anthropic.InternalServerError) as bug_exc:
            sdk.post("/v1/messages/bug", body={}, cast_to=object)
        # Answered by the request-context middleware (the traceback goes to the log).
        assert_anthropic_error(bug_exc.value, "api_error", "Internal server error")


def test_error_after_the_stream_started_is_an_error_event() -> None:
    async def events() -> AsyncIterator[Any]:
        yield PingEvent()
        raise APIError(400, "grammar failed", param="tool_choice")

    generation = types.SimpleNamespace(request_id="msg_1", cancel=lambda: None)

    async def collect() -> list[dict[str, str]]:
        return [item async for item in sse(generation, events(), "/v1/messages")]  # type: ignore[arg-type]

    sent = asyncio.run(collect())
    assert [item["event"] for item in sent] == ["ping", "error"]
    assert json.loads(sent[1]["data"]) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "tool_choice: grammar failed"},
    }
