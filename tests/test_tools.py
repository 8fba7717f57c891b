"""Tool calls end to end, and the pieces behind them.

Servers are real uvicorn servers on loopback (in this process, so a test can
script the tiny model's output, see tests/scripted.py) whose tiny models
carry the real Qwen3, Hermes-2-Pro and Mistral v0.3 chat templates
(tests/fixtures). Clients are the official openai SDK and httpx.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from flashserve.engine.generation.constraints import compile_grammar, literal
from flashserve.server.chat.output_parser import OutputParser
from flashserve.server.chat.reasoning import THINK
from flashserve.server.chat.structured import ToolChoice, tool_call_grammar
from flashserve.server.chat.tool_parsers import get_format, infer_format_name

from .conftest import TINY_EOS, Server, start_server, stop_server
from .scripted import make_templated_model, script, scripted_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City", "enum": ["Paris", "Rome"]},
                "unit": {"type": "string", "description": "Unit", "enum": ["celsius", "kelvin"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "description": "Zone", "enum": ["UTC", "CET"]}
            },
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = {"city": "Paris", "unit": "celsius"}


def hermes_call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# -- servers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_templated_model(tmp_path_factory.mktemp("tools") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Iterator[Server]:
    with scripted_server(qwen3_dir) as server:
        yield server


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_templated_model(tmp_path_factory.mktemp("tools") / "tiny-mistral", "mistral")


@pytest.fixture(scope="module")
def mistral(mistral_dir: Path) -> Iterator[Server]:
    with scripted_server(mistral_dir) as server:
        yield server


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = make_templated_model(tmp_path_factory.mktemp("tools") / "tiny-hermes", "hermes")
    with scripted_server(path) as server:
        yield server


def ask(server: Server, messages: list[dict] = ASK, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 96)
    return server.client().chat.completions.create(
        model=server.model_id, messages=messages, **kwargs
    )


def ask_streaming(
    server: Server, messages: list[dict] = ASK, **kwargs: Any
) -> tuple[Any, list[Any]]:
    """Stream through the SDK's own accumulator; return (final completion, raw chunks)."""
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 96)
    chunks = []
    with server.client().chat.completions.stream(
        model=server.model_id, messages=messages, **kwargs
    ) as stream:
        for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
        return stream.get_final_completion(), chunks


def calls_of(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# -- the tool-call round trip -----------------------------------------------------------


def test_tool_call_round_trip(qwen3: Server, qwen3_dir: Path) -> None:
    first = ask(qwen3, tools=TOOLS, **script(hermes_call("get_weather", PARIS)))
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", PARIS)]
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"

    # The call and its result go back through the chat template.
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    second = ask(qwen3, history, tools=TOOLS, **script("It is 21 degrees in Paris."))
    assert second.choices[0].message.content == "It is 21 degrees in Paris."
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].finish_reason == "stop"
    expected = AutoTokenizer.from_pretrained(qwen3_dir).apply_chat_template(
        [
            *ASK,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": PARIS},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": PARIS}) in expected
    assert second.usage.prompt_tokens == len(
        AutoTokenizer.from_pretrained(qwen3_dir).encode(expected, add_special_tokens=False)
    )


def test_streamed_tool_calls_equal_the_non_streaming_result(qwen3: Server) -> None:
    text = (
        "Checking both.\n"
        + hermes_call("get_weather", PARIS)
        + "\n"
        + hermes_call("get_time", {"zone": "CET"})
    )
    whole = ask(qwen3, tools=TOOLS, **script(text))
    final, chunks = ask_streaming(qwen3, tools=TOOLS, **script(text))
    assert calls_of(whole.choices[0].message) == [
        ("get_weather", PARIS),
        ("get_time", {"zone": "CET"}),
    ]
    assert calls_of(final.choices[0].message) == calls_of(whole.choices[0].message)
    assert final.choices[0].message.content == whole.choices[0].message.content == "Checking both."
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    # The OpenAI delta shape: a call opens with id, type and name, then argument fragments.
    pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    firsts = [p for p in pieces if p.id]
    assert [p.index for p in firsts] == [0, 1]
    assert all(p.type == "function" and p.function.name for p in firsts)
    assert all(p.id is None and p.function.name is None for p in pieces if p not in firsts)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in content and "get_weather" not in content


def test_markers_split_over_tokens_never_leak() -> None:
    """Every split of the output into deltas parses the same."""
    fmt = get_format("hermes")
    text = "<think>hmm</think>Sure." + hermes_call("get_weather", PARIS) + " done"
    results = set()
    for size in (1, 2, 3, 5, 7, len(text)):
        parser = OutputParser(reasoning=THINK, tool_format=fmt, tools=TOOLS)
        pieces = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
        pieces.append(parser.finish())
        assert "".join(p.content for p in pieces) == parser.content
        calls = tuple((c.name, c.arguments) for c in parser.tool_calls)
        results.add((parser.content, parser.reasoning_text, calls))
    assert results == {("Sure.done", "hmm", (("get_weather", json.dumps(PARIS)),))}


def test_tool_choice_none_does_not_offer_the_tools(qwen3: Server) -> None:
    text = hermes_call("get_weather", PARIS)
    plain = ask(qwen3, **script(text))
    none = ask(qwen3, tools=TOOLS, tool_choice="none", **script(text))
    offered = ask(qwen3, tools=TOOLS, **script(text))
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < offered.usage.prompt_tokens
    # Not offered, so not parsed either: the text is the answer.
    assert none.choices[0].message.content == text
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"


def test_tool_choice_required_is_enforced(qwen3: Server) -> None:
    # No script: the random model would never call a tool on its own.
    free = ask(qwen3, tools=TOOLS, max_tokens=24)
    assert not free.choices[0].message.tool_calls
    for parallel in (False, True):
        # With parallel calls the grammar allows another call or the end after each
        # call; the random model would go on calling, so the end is made likely.
        bias = {str(TINY_EOS): 50} if parallel else None
        response = ask(
            qwen3,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            logit_bias=bias,
        )
        calls = calls_of(response.choices[0].message)
        assert response.choices[0].finish_reason == "tool_calls", response
        assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
        if not parallel:
            assert len(calls) == 1
        for name, args in calls:
            tool = WEATHER if name == "get_weather" else CLOCK
            props = tool["function"]["parameters"]["properties"]
            assert set(args) == set(props)
            assert all(args[k] in props[k]["enum"] for k in args)


def test_named_tool_choice_calls_that_tool(qwen3: Server) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    response = ask(qwen3, tools=TOOLS, tool_choice=named)
    assert [name for name, _ in calls_of(response.choices[0].message)] == ["get_time"]
    final, _ = ask_streaming(qwen3, tools=TOOLS, tool_choice=named)
    assert calls_of(final.choices[0].message) == calls_of(response.choices[0].message)


@pytest.mark.parametrize(
    "text",
    [
        hermes_call("launch_rockets", {"count": 3}),
        '<tool_call>\n{"function": "get_weather", "city": "Paris"}\n</tool_call>',
    ],
    ids=["unknown-function", "no-name"],
)
def test_malformed_tool_output_comes_back_as_content(
    qwen3: Server, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A block that never named an offered function was never announced as a call:
    it is the model's text, returned as content."""
    with caplog.at_level(logging.WARNING, logger="flashserve.server.chat.output_parser"):
        response = ask(qwen3, tools=TOOLS, **script(text))
        final, _ = ask_streaming(qwen3, tools=TOOLS, **script(text))
    for message in (response.choices[0].message, final.choices[0].message):
        assert message.content == text
        assert not message.tool_calls
    assert response.choices[0].finish_reason == "stop"
    assert any("malformed" in r.getMessage() for r in caplog.records)


def test_tool_call_arguments_stream_as_the_model_writes_them(qwen3: Server) -> None:
    """The call is announced once its name is complete, and its arguments arrive in
    many fragments, the first long before the call's end marker; joined, they are
    the arguments the non-streamed response returns."""
    args = {"city": "Paris", "unit": "celsius", "note": 'a {braced} "quoted" value'}
    text = "Let me check.\n" + hermes_call("get_weather", args) + "\n"
    response = ask(qwen3, tools=TOOLS, **script(text))
    final, chunks = ask_streaming(qwen3, tools=TOOLS, **script(text))
    pieces = [
        call.function.arguments
        for chunk in chunks
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
        if call.function and call.function.arguments
    ]
    assert len(pieces) > 5, pieces
    assert json.loads("".join(pieces)) == args
    first = next(
        i for i, chunk in enumerate(chunks) if chunk.choices and chunk.choices[0].delta.tool_calls
    )
    assert chunks[first].choices[0].delta.tool_calls[0].function.name == "get_weather"
    assert not chunks[first].choices[0].delta.tool_calls[0].function.arguments
    for message in (response.choices[0].message, final.choices[0].message):
        assert message.content == "Let me check."
        assert calls_of(message) == [("get_weather", args)]
    assert (
        final.choices[0].message.tool_calls[0].function.arguments
        == response.choices[0].message.tool_calls[0].function.arguments
    )


def test_a_streamed_call_that_turns_out_malformed_is_dropped(
    qwen3: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Announced (its name was complete), then malformed: a stream has already sent
    the name and the arguments up to the error and sends nothing more for it; the
    non-streamed response leaves the call out. Neither puts the markup in content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    with caplog.at_level(logging.WARNING, logger="flashserve.server.chat.output_parser"):
        response = ask(qwen3, tools=TOOLS, **script(text))
        _, chunks = ask_streaming(qwen3, tools=TOOLS, **script(text))
    message = response.choices[0].message
    assert (message.content or "", message.tool_calls) == ("", None)
    assert response.choices[0].finish_reason == "stop"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    sent = [call for d in deltas for call in d.tool_calls or []]
    assert sent[0].function.name == "get_weather"
    assert "".join(call.function.arguments or "" for call in sent) == '{"city": }'
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert any("dropped" in r.getMessage() for r in caplog.records)


def test_bad_tool_requests_are_400_error_objects(qwen3: Server) -> None:
    http = qwen3.http()
    nameless = {"type": "function", "function": {"description": "no name"}}
    bad_args = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{oops"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "x"},
    ]
    list_args = [dict(bad_args[1])]
    list_args[0]["tool_calls"] = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "[1, 2]"},
        }
    ]
    cases = [
        ({"messages": ASK, "tools": [nameless]}, "tools.0.function.name"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, "tools.0.function"),
        ({"messages": bad_args, "tools": TOOLS}, "messages.1.tool_calls.0.function.arguments"),
        (
            {"messages": ASK + list_args, "tools": TOOLS},
            "messages.1.tool_calls.0.function.arguments",
        ),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ]
    for body, param in cases:
        response = http.post("/v1/chat/completions", json={"model": qwen3.model_id, **body})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    with pytest.raises(openai.BadRequestError):
        ask(qwen3, tools=[nameless])


# -- other templates --------------------------------------------------------------------


def test_mistral_tool_calls_and_round_trip(mistral: Server) -> None:
    text = "[TOOL_CALLS] " + json.dumps(
        [
            {"name": "get_weather", "arguments": PARIS},
            {"name": "get_time", "arguments": {"zone": "UTC"}},
        ]
    )
    first = ask(mistral, tools=TOOLS, **script(text))
    final, _ = ask_streaming(mistral, tools=TOOLS, **script(text))
    expected = [("get_weather", PARIS), ("get_time", {"zone": "UTC"})]
    assert calls_of(first.choices[0].message) == calls_of(final.choices[0].message) == expected
    assert first.choices[0].finish_reason == "tool_calls"
    # Mistral's template demands 9-character call ids; ours are mapped on the way in.
    message = first.choices[0].message
    history = (
        ASK
        + [message.model_dump(exclude_none=True)]
        + [{"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in message.tool_calls]
    )
    second = ask(mistral, history, tools=TOOLS, **script("Done."))
    assert second.choices[0].message.content == "Done."
    forced = ask(
        mistral, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert [n for n, _ in calls_of(forced.choices[0].message)] == ["get_weather"]


def test_hermes_template_round_trip_and_required(hermes: Server) -> None:
    first = ask(hermes, tools=TOOLS, **script(hermes_call("get_time", {"zone": "UTC"})))
    assert calls_of(first.choices[0].message) == [("get_time", {"zone": "UTC"})]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": first.choices[0].message.tool_calls[0].id,
            "content": "12:00",
        },
    ]
    assert (
        ask(hermes, history, tools=TOOLS, **script("Noon.")).choices[0].message.content == "Noon."
    )
    forced = ask(hermes, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(calls_of(forced.choices[0].message)) == 1


# -- formats and grammars without a server ---------------------------------------------


@pytest.mark.parametrize(
    "fmt, text, expected",
    [
        ("hermes", hermes_call("get_time", {"zone": "UTC"}), [("get_time", {"zone": "UTC"})]),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
            [("get_time", {"zone": "UTC"})],
        ),
        (
            "mistral",
            '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
            [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Rome"})],
        ),
        (
            "llama3_json",
            '{"name": "get_time", "parameters": {"zone": "CET"}}',
            [("get_time", {"zone": "CET"})],
        ),
        ("llama3_json", "Plain {answer}", []),
    ],
)
def test_formats_parse_their_calls(fmt: str, text: str, expected: list) -> None:
    parser = OutputParser(tool_format=get_format(fmt), tools=TOOLS)
    for ch in text:
        parser.feed(ch)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == expected
    assert parser.content == ("" if expected else text)


def test_format_inference_from_templates(qwen3_dir: Path, mistral_dir: Path) -> None:
    assert infer_format_name(AutoTokenizer.from_pretrained(qwen3_dir)) == "hermes"
    assert infer_format_name(AutoTokenizer.from_pretrained(mistral_dir)) == "mistral"

    class Template:
        def __init__(self, text: str):
            self.chat_template = text
            self.init_kwargs: dict = {}

        def get_vocab(self) -> dict:
            return {}

    assert infer_format_name(Template("<tool_call>\n<function=x>")) == "qwen3_coder"
    assert infer_format_name(Template("{{ '<|python_tag|>' }}<|eot_id|>")) == "llama3_json"
    assert infer_format_name(Template("{{ messages }}")) is None


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json", "qwen3_coder"])
def test_forcing_grammars_accept_what_the_parser_reads(fmt: str, qwen3_dir: Path) -> None:
    """Walk each forcing grammar with a fixed choice of allowed tokens; the text it
    lets through must parse as a call of the chosen tool."""
    import numpy as np
    from llguidance import LLMatcher

    from flashserve.engine.generation.constraints import ll_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    grammar = tool_call_grammar(
        get_format(fmt),
        TOOLS,
        ToolChoice("named", "get_time"),
        False,
        lambda s: literal(tokenizer, s),
    )
    matcher = LLMatcher(ll_tokenizer(tokenizer), compile_grammar(tokenizer, grammar.text()))
    eos = tokenizer.eos_token_id
    out: list[int] = []
    for _ in range(200):
        allowed = np.nonzero(
            np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        )[0]
        token = int(allowed[-1])  # the highest id: never the same choice as a model's
        if token == eos:
            break
        assert matcher.consume_token(token)
        out.append(token)
    text = tokenizer.decode(out)
    parser = OutputParser(tool_format=get_format(fmt), tools=TOOLS)
    parser.feed(text)
    parser.finish()
    assert [c.name for c in parser.tool_calls] == ["get_time"], text
    assert json.loads(parser.tool_calls[0].arguments)["zone"] in ("UTC", "CET")


# -- the default model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(None, tmp_path_factory.mktemp("default-tools"))
    yield server
    stop_server(server)


def test_default_model_answers_with_tools(default_server: Server) -> None:
    """SmolLM2's template ignores tools, so they are offered in a system message."""
    client = default_server.client()
    model = default_server.model_id
    response = client.chat.completions.create(
        model=model, messages=ASK, tools=[CLOCK], temperature=0, max_tokens=12
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    for name, args in calls_of(choice.message):
        assert name == "get_time" and isinstance(args, dict)
    # A model with no tool format of its own still honours tool_choice required.
    forced = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[CLOCK],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=40,
    )
    assert forced.choices[0].finish_reason == "tool_calls"
    assert calls_of(forced.choices[0].message)[0][0] == "get_time"


# -- response_format ----------------------------------------------------------------------

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "capital": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "sure": {"type": "boolean"},
    },
    "required": ["capital", "sure"],
    "additionalProperties": False,
}


def test_response_format_json_schema_is_enforced(qwen3: Server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    response = ask(qwen3, response_format=fmt)
    answer = json.loads(response.choices[0].message.content)
    assert answer["capital"] in ("Paris", "Rome", "Oslo") and isinstance(answer["sure"], bool)
    assert set(answer) == {"capital", "sure"}
    assert response.choices[0].finish_reason == "stop"
    chunks = list(ask(qwen3, response_format=fmt, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == response.choices[0].message.content


def test_response_format_json_object(qwen3: Server) -> None:
    response = ask(qwen3, response_format={"type": "json_object"}, max_tokens=48)
    text = response.choices[0].message.content
    assert text.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    free = ask(qwen3, max_tokens=8)
    assert not (free.choices[0].message.content or "").startswith("{")


def test_bad_response_formats_are_400(qwen3: Server) -> None:
    http = qwen3.http()
    for response_format in (
        {"type": "yaml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    ):
        response = http.post(
            "/v1/chat/completions",
            json={"model": qwen3.model_id, "messages": ASK, "response_format": response_format},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "response_format"


RECURSIVE_SCHEMA = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}


def test_constraints_that_cannot_be_enforced_are_never_dropped(qwen3: Server) -> None:
    """A grammar llguidance cannot run (a schema that requires itself) is a 400 naming the
    field, or an error that ends the request: never 200 with unconstrained text."""
    http = qwen3.http()
    recursive_tool = {
        "type": "function",
        "function": {"name": "nest", "parameters": RECURSIVE_SCHEMA},
    }
    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": RECURSIVE_SCHEMA},
                }
            },
            "response_format",
        ),
        ({"tools": [recursive_tool], "tool_choice": "required"}, "tool_choice"),
    ]
    for extra, param in cases:
        for stream in (False, True):
            body = {"model": qwen3.model_id, "messages": ASK, "max_tokens": 32, **extra}
            response = http.post("/v1/chat/completions", json={**body, "stream": stream})
            if response.status_code == 400:
                error = response.json()["error"]
                assert error["param"] == param, error
                assert "Too many" in error["message"] or "cannot" in error["message"].lower()
                continue
            # Accepted: the failure must then end the request with an error, never
            # a finished answer without the constraint.
            assert stream, response.text
            assert '"error"' in response.text, response.text
            assert 'finish_reason":"stop' not in response.text


def test_parallel_tool_calls_false_keeps_one_call_under_auto(qwen3: Server) -> None:
    """With tool_choice auto nothing constrains the model, so a second call it writes
    is read and left out (never announced, never content), streamed or not."""
    text = hermes_call("get_weather", PARIS) + "\n" + hermes_call("get_weather", {"city": "Rome"})
    for parallel, expected in ((False, [("get_weather", PARIS)]), (True, None)):
        response = ask(qwen3, tools=TOOLS, parallel_tool_calls=parallel, **script(text))
        final, chunks = ask_streaming(
            qwen3, tools=TOOLS, parallel_tool_calls=parallel, **script(text)
        )
        for message in (response.choices[0].message, final.choices[0].message):
            assert not message.content, message
            calls = calls_of(message)
            assert calls == (
                expected or [("get_weather", PARIS), ("get_weather", {"city": "Rome"})]
            )
        announced = [
            call.function.name
            for chunk in chunks
            for choice in chunk.choices
            for call in choice.delta.tool_calls or []
            if call.function and call.function.name
        ]
        assert len(announced) == (1 if not parallel else 2)
        assert response.choices[0].finish_reason == "tool_calls"


def test_text_after_a_dropped_call_has_no_leading_layout(qwen3: Server) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nafter'
    response = ask(qwen3, tools=TOOLS, **script(text))
    assert response.choices[0].message.content == "after"
