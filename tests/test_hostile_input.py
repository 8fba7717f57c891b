"""Hostile request bodies against a real server: nothing freezes it, nothing is a 500.

Prompt rendering and tokenizing run off the event loop, so /health answers
while another client's 4 MB prompt is tokenized or a hostile chat template
runs. Client chat templates are off unless allowed; when allowed, they run in
a sandbox with limits on time and size. Bad input (lone surrogates echoed into
messages, odd logit_bias keys, deep nesting, an empty rendered prompt) gets a
4xx OpenAI error object and one log line, never a traceback.

Bodies are sent as raw bytes: JSON may escape a lone surrogate (\\ud800) that a
Python client could not encode.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flashserve.server.chat.prompts import RenderSlots
from flashserve.server.http.errors import APIError

from .conftest import Server, start_server, stop_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
TEMPLATE_TIMEOUT_S = 1.0
HEALTH_BOUND_S = 0.5


@pytest.fixture(scope="module")
def open_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Client chat templates allowed, with a short template_timeout."""
    server = start_server(
        tiny_llama_dir,
        tmp_path_factory.mktemp("hostile"),
        "--allow-client-chat-template",
        "--template-timeout",
        str(TEMPLATE_TIMEOUT_S),
    )
    yield server
    stop_server(server)


def post_raw(server: Server, path: str, raw: str | bytes, timeout: float = 120) -> httpx.Response:
    content = raw.encode() if isinstance(raw, str) else raw
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    return error


def while_health_polled(server: Server, send: Any) -> tuple[Any, float, float]:
    """Run `send()` in a thread, polling /health meanwhile.

    Returns (send's result, the slowest /health answer, send's duration)."""
    result: list[Any] = []
    started = time.monotonic()
    took: list[float] = []

    def run() -> None:
        result.append(send())
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=run)
    thread.start()
    slowest = 0.0
    with httpx.Client(base_url=server.url, timeout=60) as client:
        time.sleep(0.1)  # the request is in
        while thread.is_alive():
            t0 = time.monotonic()
            assert client.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
    thread.join()
    return result[0], slowest, took[0]


def chat_with_template(template: str) -> str:
    body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"chat_template": template}}
    return json.dumps(body)


# -- (1) rendering never freezes the server ---------------------------------------------


def test_client_chat_template_is_off_by_default(llama_server: Server) -> None:
    response = post_raw(llama_server, CHAT, chat_with_template("{{ 'hi' }}"))
    error = error_of(response, 400)
    assert error["param"] == "chat_template_kwargs.chat_template"
    assert "allow_client_chat_template" in error["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_health_answers_while_a_4mb_prompt_is_tokenized(llama_server: Server, path: str) -> None:
    # Just under max_body_bytes (4 MB): legitimate, and far over the tiny context.
    text = "y " * 1_950_000
    prompt = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
    body = json.dumps(prompt)
    assert 3_800_000 < len(body) < 4_000_000
    response, slowest, _ = while_health_polled(
        llama_server, lambda: post_raw(llama_server, path, body)
    )
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f} s"
    # Far over the context; on a very slow machine, over template_timeout (10 s) first.
    assert error_of(response, 400)["code"] in ("context_length_exceeded", "template_timeout")


HOSTILE_TEMPLATES = {
    # 20 MB from one expression: refused when asked, not tokenized for 45 s.
    "huge string": '{{ "x" * 20000000 }}',
    "huge list": "{{ (range(10000)|list) * 100000 }}",
    # 10^10 empty iterations: stopped by the time limit.
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
    # Loops over a list the template built, with no call inside the inner loop.
    "nested loops over a list": (
        "{% set xs = range(100000)|list %}"
        "{% for i in xs %}{% for j in xs %}{% endfor %}{% endfor %}"
    ),
    # Doubling a string with ~ (no operator the sandbox intercepts by default).
    "doubling concat": (
        '{% set ns = namespace(s="x") %}'
        "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    ),
    # 2^40 macro calls.
    "exponential macro": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    ),
    "huge int power": "{{ 10 ** 100000000 }}",
    "huge format width": "{{ '%0999999999d' % 1 }}",
    "huge center": "{{ 'x'|center(999999999) }}",
    "huge str method": "{{ 'x'.ljust(999999999) }}",
    "shared list flattened": (
        "{% set a = ['y' * 100000] * 10 %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}"
        "{% set c = [b, b, b, b, b, b, b, b, b, b] %}{{ c|tojson }}"
    ),
    "static text in a captured loop": (
        "{% set s %}{% for i in range(100000) %}{% for j in range(1000) %}"
        + "z" * 1000
        + "{% endfor %}{% endfor %}{% endset %}{{ s|length }}"
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_template_is_stopped_and_health_answers(open_server: Server, name: str) -> None:
    raw = chat_with_template(HOSTILE_TEMPLATES[name])
    response, slowest, took = while_health_polled(
        open_server, lambda: post_raw(open_server, CHAT, raw)
    )
    error = error_of(response, 400)
    assert error["code"] in ("template_timeout", "template_limit"), error
    assert took < TEMPLATE_TIMEOUT_S + 1.5, f"answered after {took:.1f} s"
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f} s"


def test_allowed_client_template_renders(open_server: Server) -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|upper }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"
    )
    response = post_raw(open_server, CHAT, chat_with_template(template))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 3


def test_template_rendering_to_an_empty_prompt_is_a_400(open_server: Server) -> None:
    for template in ("", "{{ '' }}", "{% if false %}x{% endif %}"):
        error = error_of(post_raw(open_server, CHAT, chat_with_template(template)), 400)
        assert "empty" in error["message"]


def test_template_errors_are_400s(open_server: Server) -> None:
    for template in (
        "{% for %}",  # syntax
        "{{ raise_exception('no system messages') }}",
        "{{ 1 / 0 }}",
        "{{ ''.__class__.__mro__ }}",  # the sandbox
        "{% include 'x.jinja' %}",
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",  # recursion
    ):
        response = post_raw(open_server, CHAT, chat_with_template(template))
        assert error_of(response, 400)["param"] is not None, template


def test_server_sets_the_template_inputs(open_server: Server) -> None:
    for key in ("messages", "tools", "add_generation_prompt"):
        body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {key: []}}
        error = error_of(post_raw(open_server, CHAT, json.dumps(body)), 400)
        assert error["param"] == f"chat_template_kwargs.{key}"


def test_render_slots_bound_runaway_renders() -> None:
    """A render that outlives its time keeps its slot until it ends: runaway renders
    cannot pile up threads, and a request that finds every slot taken gets a 503."""
    slots = RenderSlots(1)
    release = threading.Event()

    async def scenario() -> None:
        with pytest.raises(APIError) as stuck:
            await slots.run(lambda deadline: release.wait(10), timeout=0.2, param="messages")
        assert stuck.value.status == 400 and stuck.value.detail.code == "template_timeout"
        t0 = time.monotonic()
        with pytest.raises(APIError) as busy:
            await slots.run(lambda deadline: "never runs", timeout=0.3, param="messages")
        assert busy.value.status == 503 and busy.value.detail.code == "render_busy"
        assert 0.25 < time.monotonic() - t0 < 2.0
        release.set()
        assert await slots.run(lambda deadline: "ran", timeout=5, param="messages") == "ran"

    asyncio.run(scenario())


# -- (6) bad input is a 4xx error object, never a 500 -------------------------------------

DEEP = 900
# Raw JSON fields, so a body can carry what a JSON encoder would not write.
PROMPT_FIELD = {CHAT: '"messages":[{"role":"user","content":"hi"}]', COMPLETIONS: '"prompt":"hi"'}


def raw_body(*fields: str) -> str:
    return "{" + ",".join(fields) + "}"


def nested_list(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def test_lone_surrogate_in_the_model_name(open_server: Server) -> None:
    for path, prompt in PROMPT_FIELD.items():
        raw = raw_body('"model":"\\ud800"', prompt, '"max_tokens":1')
        response = post_raw(open_server, path, raw)
        error = error_of(response, 404)
        assert error["code"] == "model_not_found"
        assert "\\ud800" in error["message"]


def test_lone_surrogate_in_a_content_part_type(open_server: Server) -> None:
    raw = raw_body('"messages":[{"role":"user","content":[{"type":"\\ud800","text":"x"}]}]')
    error = error_of(post_raw(open_server, CHAT, raw), 400)
    assert error["param"].startswith("messages.0.content")


def test_lone_surrogate_in_a_key(open_server: Server) -> None:
    raw = raw_body(PROMPT_FIELD[CHAT], '"logit_bias":{"\\udfff":1}')
    error_of(post_raw(open_server, CHAT, raw), 400)


@pytest.mark.parametrize("key", ["\\u00b2", "1" * 5000, "1_0", "\\u0661", " ", ""])
def test_logit_bias_keys_that_int_refuses(open_server: Server, key: str) -> None:
    for path, prompt in PROMPT_FIELD.items():
        raw = raw_body(prompt, '"max_tokens":1', '"logit_bias":{"' + key + '":1}')
        error = error_of(post_raw(open_server, path, raw), 400)
        assert error["param"] == "logit_bias"
        assert len(error["message"]) < 400


@pytest.mark.parametrize(
    ("path", "before", "after"),
    [
        (CHAT, '"messages":[{"role":"user","content":"hi","extra":', "}]"),
        (CHAT, PROMPT_FIELD[CHAT] + ',"chat_template_kwargs":{"x":', "}"),
        (CHAT, PROMPT_FIELD[CHAT] + ',"response_format":{"type":"json_schema","json_schema":', "}"),
        (COMPLETIONS, PROMPT_FIELD[COMPLETIONS] + ',"metadata":', ""),
        (COMPLETIONS, PROMPT_FIELD[COMPLETIONS] + ',"user":', ""),
    ],
)
@pytest.mark.parametrize("depth", [DEEP, 5000])
@pytest.mark.parametrize("shape", [nested_list, nested_object])
def test_deep_nesting_is_a_400_naming_the_limit(
    open_server: Server, path: str, before: str, after: str, depth: int, shape: Any
) -> None:
    raw = raw_body(before + shape(depth) + after, '"max_tokens":1')
    error = error_of(post_raw(open_server, path, raw), 400)
    assert "nested deeper than 64" in error["message"], error


def test_nesting_within_the_limit_is_served(open_server: Server) -> None:
    extra = '"messages":[{"role":"user","content":"hi","extra":' + nested_list(60) + "}]"
    raw = raw_body(extra, '"max_tokens":1')
    assert post_raw(open_server, CHAT, raw).status_code == 200


def test_a_number_past_the_digit_limit_is_a_400(open_server: Server) -> None:
    for path, prompt in PROMPT_FIELD.items():
        raw = raw_body(prompt, '"max_tokens":' + "9" * 5000)
        assert "too many digits" in error_of(post_raw(open_server, path, raw), 400)["message"]


def test_a_tiny_temperature_is_greedy(open_server: Server) -> None:
    # 1 / 1e-300 overflows float32: sampling drew any token and broke the grammar
    # of response_format mid-stream (an error event after a 200).
    body = {
        "messages": HI,
        "max_tokens": 3,
        "temperature": 1e-300,
        "response_format": {"type": "json_object"},
        "stream": True,
    }
    response = post_raw(open_server, CHAT, json.dumps(body))
    assert response.status_code == 200
    assert '"error"' not in response.text, response.text[-500:]
    body["stream"] = False
    greedy = {**body, "temperature": 0}
    tiny = post_raw(open_server, CHAT, json.dumps(body)).json()
    zero = post_raw(open_server, CHAT, json.dumps(greedy)).json()
    assert tiny["choices"][0]["message"] == zero["choices"][0]["message"]


def test_bad_input_leaves_no_traceback_in_the_log(open_server: Server) -> None:
    # Runs after the tests above (file order): each bad request was one access-log line.
    log = open_server.log_tail(10**8)
    assert "Traceback" not in log
    assert "Logging error" not in log
    assert len(log) < 200_000, "a request logged far more than one line"
