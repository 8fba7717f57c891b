"""Property-based fuzz of the request schemas against a real server (hypothesis).

Bodies mix plausible values, boundary values and arbitrary JSON in every field,
and hostile ones: lone surrogates (JSON escapes Python cannot encode), numbers
past any limit (a 5,000-digit literal), nesting past the depth limit, odd
logit_bias keys, tools, response formats, chat templates from the client.
Whatever the body: never a 5xx, never a traceback-shaped answer, an OpenAI error
object on every 4xx, a well-formed answer or stream on 200, and the worker
alive afterwards. Bounded: a tiny model, at most a few tokens per answer
(--default-max-tokens 4 for bodies that set none), derandomized examples.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Server, start_server, stop_server

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,  # the same examples on every run: a CI failure reproduces
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("fuzz"),
        "--default-max-tokens",
        "4",
        "--allow-client-chat-template",
        "--template-timeout",
        "5",
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def http(fuzz_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:
        yield client


# -- strategies -------------------------------------------------------------------------

# A number literal past Python's int-from-string limit (4,300 digits): json.dumps cannot
# write one, so strategies write this marker and encode() puts the digits in.
HUGE_NUMBER = "@@huge-number@@"
HUGE_DIGITS = "9" * 5000

# Integers are small (valid token budgets) or huge (past any context, past int64), never
# in between: a mid-size max_tokens would just make the tiny model talk for seconds.
ints = st.one_of(
    st.integers(-3, 8),
    st.integers(2**31, 2**70),
    st.integers(-(2**70), -(2**31)),
)
# Now and then (such a body never parses, so not too often).
huge = st.just(HUGE_NUMBER)
# Text with what breaks naive handling now and then: lone surrogates, digits int()
# refuses, NUL, a character JSON must escape.
odd_chars = st.sampled_from(["\ud800", "\udfff", "\u00b2", "\u0661", "\x00", '"', "\u2028"])
text_chars = st.one_of(st.characters(), odd_chars)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(text_chars, max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=6,
)


def nested(depth: int) -> str:
    """JSON text nesting `depth` containers, lists and objects in turn."""
    opens = "".join("[" if level % 2 else '{"k":' for level in range(depth))
    closes = "".join("]" if level % 2 else "}" for level in reversed(range(depth)))
    return opens + "1" + closes


# Around the body's depth limit (64), and far past it (Python's recursion limit).
# Written as markers: neither json.dumps nor hypothesis's reports recurse that deep.
DEPTHS = [8, 60, 63, 64, 65, 100, 900, 3000]
deep_values = st.sampled_from([f"@@deep-{depth}@@" for depth in DEPTHS])


def field(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything."""
    return st.one_of(plausible, plausible, json_values)


# Two families of bodies per endpoint. "Valid" ones stay inside the schema (edge values
# included: temperature 0 and 2, huge seeds, odd stop strings, strong logit biases) and
# so reach the engine; "chaotic" ones put anything anywhere and exercise the validators.
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
text = st.text(max_size=40)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
valid_message = st.fixed_dictionaries(
    {"role": roles, "content": st.one_of(text, st.lists(text_part, min_size=1, max_size=2))},
    optional={"name": st.text(min_size=1, max_size=8)},
)
valid_sampling = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 200),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 3),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=8),
}
tool_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)
json_types = st.sampled_from(["string", "integer", "number", "boolean"])
valid_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": tool_name},
            optional={
                "description": text,
                "parameters": st.fixed_dictionaries(
                    {
                        "type": st.just("object"),
                        "properties": st.dictionaries(
                            tool_name, st.fixed_dictionaries({"type": json_types}), max_size=2
                        ),
                    }
                ),
            },
        ),
    }
)
valid_response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {
                    "name": tool_name,
                    "schema": st.fixed_dictionaries(
                        {
                            "type": st.just("object"),
                            "properties": st.dictionaries(
                                tool_name, st.fixed_dictionaries({"type": json_types}), max_size=2
                            ),
                        }
                    ),
                }
            ),
        }
    ),
)
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(valid_message, min_size=1, max_size=3)},
    optional={
        **valid_sampling,
        "max_completion_tokens": st.integers(1, 6),
        "tools": st.lists(valid_tool, min_size=1, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none"]),
        "response_format": valid_response_format,
        "chat_template_kwargs": st.fixed_dictionaries(
            {}, optional={"enable_thinking": st.booleans()}
        ),
    },
)
valid_completion = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            text,
            st.lists(text, min_size=1, max_size=1),
            st.lists(st.integers(-5, 700), min_size=1, max_size=8),  # ids past the vocabulary too
        )
    },
    optional=valid_sampling,
)

chaotic_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "", "\ud800"])},
    optional={"text": field(st.text(max_size=12))},
)
content = field(st.one_of(st.text(text_chars, max_size=40), st.lists(chaotic_part, max_size=2)))
message = st.fixed_dictionaries(
    {
        "role": field(
            st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot", "\ud800"])
        )
    },
    optional={
        "content": content,
        "name": field(st.text(max_size=8)),
        "tool_calls": json_values,
        "tool_call_id": field(st.text(max_size=8)),
        "extra": deep_values,
    },
)
stop = field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5)))
odd_token_keys = st.sampled_from(
    ["\u00b2", "\u0661", "1_0", " 5 ", "-1", "+1", "0x1", "1" * 5000, "", "\ud800", "1e3"]
)
logit_bias = field(
    st.dictionaries(
        st.one_of(st.integers(-10, 600).map(str), st.text(text_chars, max_size=4), odd_token_keys),
        st.one_of(st.floats(-150, 150), st.floats(-150, 150), st.floats(-150, 150), huge),
        max_size=3,
    )
)
sampling = {
    "model": field(st.sampled_from(["tiny-llama", "gpt-4o", ""])),
    "max_tokens": st.one_of(field(st.integers(-2, 6)), field(st.integers(-2, 6)), huge),
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-3, 100)),
    "min_p": field(st.floats(-0.5, 1.5)),
    "seed": st.one_of(field(st.integers(-(2**70), 2**70)), huge),
    "stop": stop,
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 3)),
    "logit_bias": logit_bias,
    "n": field(st.integers(0, 3)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": st.one_of(json_values, deep_values),
    "metadata": deep_values,
}
# Client templates (the fuzz server allows them): fine ones, failing ones, and ones
# the sandbox's size limits stop at once. None that loops until the time limit.
client_templates = st.sampled_from(
    [
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
        "{{ messages|tojson }}",
        "",
        "{% for %}",
        "{{ raise_exception('no') }}",
        "{{ 1 / 0 }}",
        "{{ x.y.z }}",
        '{{ "x" * 20000000 }}',
        "{{ 'x'|center(999999999) }}",
        "{{ ''.__class__ }}",
        "{{ messages[0].content * 1000000000 }}",
    ]
)
chat_template_kwargs = st.one_of(
    json_values,
    deep_values,
    st.fixed_dictionaries(
        {},
        optional={
            "chat_template": field(client_templates),
            "enable_thinking": field(st.booleans()),
            "messages": json_values,
            "tools": json_values,
            "add_generation_prompt": json_values,
            "documents": json_values,
        },
    ),
)
chaotic_tools = st.one_of(
    json_values,
    st.lists(st.one_of(valid_tool, json_values), max_size=2),
)
chaotic_tool_choice = st.one_of(
    st.sampled_from(["auto", "none", "required", "\ud800"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": field(tool_name)})}
    ),
)
chaotic_response_format = st.one_of(
    valid_response_format,
    st.fixed_dictionaries({"type": st.sampled_from(["text", "x", "json_schema", "\ud800"])}),
    st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.one_of(json_values, deep_values)}
    ),
)
chaotic_chat = st.fixed_dictionaries(
    {"messages": field(st.lists(message, max_size=3))},
    optional={
        **sampling,
        "max_completion_tokens": field(st.integers(-2, 6)),
        "tools": chaotic_tools,
        "tool_choice": field(chaotic_tool_choice),
        "response_format": field(chaotic_response_format),
        "parallel_tool_calls": field(st.booleans()),
        "logprobs": field(st.booleans()),
        "chat_template_kwargs": chat_template_kwargs,
    },
)
prompt = field(
    st.one_of(
        st.text(text_chars, max_size=40),
        st.lists(st.text(max_size=10), max_size=2),
        st.lists(st.integers(-5, 700), max_size=8),
        st.lists(st.lists(st.integers(-5, 700), max_size=4), max_size=2),
    )
)
chaotic_completion = st.fixed_dictionaries(
    {"prompt": prompt},
    optional={
        **sampling,
        "echo": field(st.booleans()),
        "suffix": field(st.text(max_size=4)),
        "best_of": field(st.integers(0, 3)),
        "logprobs": field(st.integers(0, 3)),
    },
)
chat_request = st.one_of(valid_chat, chaotic_chat)
completion_request = st.one_of(valid_completion, chaotic_completion)


# -- checks ---------------------------------------------------------------------------


def post(http: httpx.Client, path: str, content: bytes) -> tuple[httpx.Response, bytes]:
    headers = {"Content-Type": "application/json"}
    with http.stream("POST", path, content=content, headers=headers) as response:
        return response, response.read()


def check(response: httpx.Response, raw: bytes, sent: bytes) -> None:
    status = response.status_code
    where = f"{status} for {sent[:300]!r}: {raw[:300]!r}"
    assert status < 500, where
    if status >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert error["message"] and "Traceback" not in error["message"], where
        return
    assert status == 200, where
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [ln[5:].strip() for ln in raw.decode().splitlines() if ln.startswith("data:")]
        assert lines and lines[-1] == "[DONE]", where
        for line in lines[:-1]:
            chunk = json.loads(line)
            # An error after the headers went out is a 500 in disguise.
            assert "error" not in chunk, where
    else:
        answer = json.loads(raw)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), where


def encode(body: Any) -> bytes:
    # NaN/Infinity: invalid JSON, on purpose. ASCII: lone surrogates go as \ud800 escapes.
    text = json.dumps(body, allow_nan=True).replace(json.dumps(HUGE_NUMBER), HUGE_DIGITS)
    for depth in DEPTHS:
        text = text.replace(f'"@@deep-{depth}@@"', nested(depth))
    return text.encode()


@settings(FUZZ, max_examples=200)
@given(body=chat_request)
def test_fuzz_chat_completions(http: httpx.Client, body: dict[str, Any]) -> None:
    sent = encode(body)
    check(*post(http, "/v1/chat/completions", sent), sent)


@settings(FUZZ, max_examples=120)
@given(body=completion_request)
def test_fuzz_completions(http: httpx.Client, body: dict[str, Any]) -> None:
    sent = encode(body)
    check(*post(http, "/v1/completions", sent), sent)


@settings(FUZZ, max_examples=50)
@given(raw=st.one_of(st.binary(max_size=64), json_values.map(encode)))
def test_fuzz_raw_bodies(http: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        check(*post(http, path, raw), raw)


def test_worker_alive_after_fuzz(fuzz_server: Server, http: httpx.Client) -> None:
    health = fuzz_server.wait_idle(30)
    assert health["status"] == "ok" and not health["busy"]
    answer = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] <= 4
    assert "Traceback" not in fuzz_server.log_tail(1_000_000)
