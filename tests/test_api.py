"""The OpenAI API of `flashserve serve`, end to end: a real server process on
loopback with a tiny random-weight llama, driven by the official openai SDK
and httpx.

The tiny model's words are random, so no test hard-codes an output: expected
texts come from earlier requests to the same server (e.g. a stop string is cut
out of the greedy output). Its end-of-sequence token is banned with logit_bias
(NO_EOS) where a test needs a known number of tokens.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from .conftest import NO_EOS, Server

PROMPT = "Hello, how are you?"
CONTEXT = 2048  # max_position_embeddings of engine.synthetic's models


def chat(client: openai.OpenAI, content: str = PROMPT, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("model", "tiny-llama")
    return client.chat.completions.create(messages=[{"role": "user", "content": content}], **kwargs)


def stream_chat(client: openai.OpenAI, content: str = PROMPT, **kwargs: Any) -> list[Any]:
    return list(chat(client, content, stream=True, **kwargs))


def chunks_text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def sse_data(response: httpx.Response) -> list[str]:
    return [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]


# -- health and models ----------------------------------------------------------------


def test_health_reports_the_loaded_model(llama_server: Server) -> None:
    response = llama_server.health()
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["model"] == "tiny-llama"
    assert body["busy"] is False and body["queued"] == 0


def test_models_list_and_retrieve(llama_server: Server) -> None:
    client = llama_server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert models.data[0].object == "model"
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"


# -- chat completions -----------------------------------------------------------------


def test_chat_non_streaming(llama_server: Server, tiny_llama_dir: Path) -> None:
    response = chat(llama_server.client(), max_tokens=12, logit_bias=NO_EOS)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == "tiny-llama"
    assert abs(response.created - time.time()) < 300
    (choice,) = response.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    # The prompt is the chat template's rendering, counted with the model's own tokenizer.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 12)
    assert usage.total_tokens == prompt_tokens + 12


def test_max_completion_tokens_and_the_default_budget(llama_server: Server) -> None:
    client = llama_server.client()
    response = chat(client, max_tokens=None, max_completion_tokens=5, logit_bias=NO_EOS)
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"
    # Without max_tokens the budget is what the context leaves (tiny model: 2048).
    long_prompt = "hello " * 400  # about 1600 tokens
    response = chat(client, long_prompt, max_tokens=None, logit_bias=NO_EOS)
    usage = response.usage
    assert usage.prompt_tokens + usage.completion_tokens == CONTEXT
    assert response.choices[0].finish_reason == "length"


def test_streaming_equals_non_streaming_with_usage(llama_server: Server) -> None:
    client = llama_server.client()
    whole = chat(client, max_tokens=20, logit_bias=NO_EOS)
    chunks = stream_chat(
        client, max_tokens=20, logit_bias=NO_EOS, stream_options={"include_usage": True}
    )
    assert chunks_text(chunks) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *content_chunks, usage_chunk = chunks
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    # include_usage: a last chunk with empty choices and the same usage.
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()


def test_stream_is_sse_ending_with_done(llama_server: Server) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "stream": True,
    }
    response = llama_server.http().post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    data = sse_data(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # Without include_usage no chunk carries usage.
    assert all(c.get("usage") is None for c in chunks)


def _stop_string_in(text: str) -> str:
    """A two-character piece of `text` whose first occurrence is not at the start."""
    for i in range(1, len(text) - 1):
        piece = text[i : i + 2]
        if "\ufffd" not in piece and text.find(piece) == i:
            return piece
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_sequences_cut_the_text_and_are_not_emitted(llama_server: Server) -> None:
    client = llama_server.client()
    base = chat(client, max_tokens=40, logit_bias=NO_EOS).choices[0].message.content
    stop = _stop_string_in(base)
    expected = base[: base.find(stop)]

    response = chat(client, max_tokens=40, logit_bias=NO_EOS, stop=[stop, "never-in-output"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"

    chunks = stream_chat(client, max_tokens=40, logit_bias=NO_EOS, stop=stop)
    assert chunks_text(chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_same_seed_same_text(llama_server: Server) -> None:
    client = llama_server.client()
    runs = [
        chat(client, temperature=1.0, seed=1234, max_tokens=24, logit_bias=NO_EOS)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and runs[0]


def test_sampling_parameters_are_applied(llama_server: Server, tiny_llama_dir: Path) -> None:
    client = llama_server.client()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    (x,) = tokenizer.encode("x", add_special_tokens=False)
    # A +100 bias makes one token win every step.
    forced = chat(client, max_tokens=6, logit_bias={str(x): 100})
    assert forced.choices[0].message.content == "x" * 6
    # Every knob at once is accepted and generates.
    response = chat(
        client,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        max_tokens=8,
        logit_bias=NO_EOS,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert response.usage.completion_tokens == 8


def test_content_as_text_parts_and_developer_role(llama_server: Server) -> None:
    client = llama_server.client()
    plain = chat(client, "Hello,\nhow are you?", max_tokens=8)
    parts = client.chat.completions.create(
        model="tiny-llama",
        temperature=0,
        max_tokens=8,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hello,"},
                    {"type": "text", "text": "how are you?"},
                ],
            }
        ],
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    system = client.chat.completions.create(
        model="tiny-llama",
        temperature=0,
        max_tokens=8,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
    )
    developer = client.chat.completions.create(
        model="tiny-llama",
        temperature=0,
        max_tokens=8,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": PROMPT},
        ],
    )
    assert developer.choices[0].message.content == system.choices[0].message.content
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens


def test_two_concurrent_requests_match_their_sequential_results(llama_server: Server) -> None:
    client = llama_server.client()
    prompts = ["Hello, how are you?", "What is the weather today?"]

    def one(prompt: str) -> str:
        return chat(client, prompt, max_tokens=24, logit_bias=NO_EOS).choices[0].message.content

    sequential = [one(p) for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        concurrent = list(pool.map(one, prompts))
    assert concurrent == sequential
    assert sequential[0] != sequential[1]


# -- completions ----------------------------------------------------------------------


def test_completions_non_streaming_and_streaming(llama_server: Server) -> None:
    client = llama_server.client()
    kwargs: dict[str, Any] = {
        "model": "tiny-llama",
        "temperature": 0,
        "max_tokens": 10,
        "logit_bias": NO_EOS,
    }
    whole = client.completions.create(prompt="The capital of France is", **kwargs)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 10

    listed = client.completions.create(prompt=["The capital of France is"], **kwargs)
    assert listed.choices[0].text == choice.text

    chunks = list(
        client.completions.create(
            prompt="The capital of France is",
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"


def test_a_streamed_space_comes_with_its_own_token(
    llama_server: Server, tiny_llama_dir: Path
) -> None:
    """A completion made of lone-space tokens streams one chunk per token: mlx-lm's
    detokenizer would hold each space for the next token, so none went out before the
    end (engine/generation/choices.py: SpacesAtOnce)."""
    space = AutoTokenizer.from_pretrained(str(tiny_llama_dir)).encode(" ", add_special_tokens=False)
    assert len(space) == 1
    kwargs: dict[str, Any] = {
        "model": "tiny-llama",
        "prompt": "The capital of France is",
        "temperature": 0,
        "max_tokens": 4,
        "logit_bias": {**NO_EOS, str(space[0]): 100},
    }
    client = llama_server.client()
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert texts == [" "] * 4 and "".join(texts) == whole


def test_completions_stop(llama_server: Server) -> None:
    client = llama_server.client()
    kwargs: dict[str, Any] = {
        "model": "tiny-llama",
        "prompt": "Hello",
        "temperature": 0,
        "max_tokens": 30,
        "logit_bias": NO_EOS,
    }
    base = client.completions.create(**kwargs).choices[0].text
    stop = _stop_string_in(base)
    cut = client.completions.create(stop=stop, **kwargs).choices[0]
    assert cut.text == base[: base.find(stop)] and cut.finish_reason == "stop"


# -- errors ---------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"

# (name, method, path, JSON body or raw text, status, expected param, expected code)
ERROR_CASES = [
    ("malformed json", "POST", CHAT, '{"messages": [', 400, None, "invalid_json"),
    ("body not an object", "POST", CHAT, "[1, 2]", 400, None, None),
    (
        "lone surrogate in content",
        "POST",
        CHAT,
        '{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "messages",
        None,
    ),
    ("seed out of range", "POST", CHAT, {"messages": USER, "seed": 2**65}, 400, "seed", None),
    (
        "wrong type",
        "POST",
        CHAT,
        {"messages": USER, "temperature": "hot"},
        400,
        "temperature",
        "invalid_type",
    ),
    (
        "out of range",
        "POST",
        CHAT,
        {"messages": USER, "temperature": 5},
        400,
        "temperature",
        "invalid_value",
    ),
    (
        "missing messages",
        "POST",
        CHAT,
        {"model": "tiny-llama"},
        400,
        "messages",
        "missing_required_parameter",
    ),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "messages", "invalid_value"),
    ("messages not a list", "POST", CHAT, {"messages": "hi"}, 400, "messages", "invalid_type"),
    (
        "unknown role",
        "POST",
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages.0.role",
        None,
    ),
    (
        "missing content",
        "POST",
        CHAT,
        {"messages": [{"role": "user"}]},
        400,
        "messages.0.content",
        "missing_required_parameter",
    ),
    (
        "image content",
        "POST",
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        },
        400,
        "messages.0.content.0",
        None,
    ),
    (
        "unknown model",
        "POST",
        CHAT,
        {"model": "gpt-4o", "messages": USER},
        404,
        "model",
        "model_not_found",
    ),
    # n above the server's max_batch (8 by default).
    ("n=9", "POST", CHAT, {"messages": USER, "n": 9}, 400, "n", "invalid_value"),
    ("max_tokens 0", "POST", CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens", None),
    (
        "logit_bias id outside vocab",
        "POST",
        CHAT,
        {"messages": USER, "logit_bias": {"999999": 1}},
        400,
        "logit_bias",
        None,
    ),
    (
        "logit_bias value out of range",
        "POST",
        CHAT,
        {"messages": USER, "logit_bias": {"5": 101}},
        400,
        "logit_bias",
        None,
    ),
    (
        "logit_bias key not an id",
        "POST",
        CHAT,
        {"messages": USER, "logit_bias": {"abc": 1}},
        400,
        "logit_bias",
        None,
    ),
    (
        "stop not strings",
        "POST",
        CHAT,
        {"messages": USER, "stop": [1]},
        400,
        "stop",
        "invalid_type",
    ),
    (
        "top_logprobs without logprobs",
        "POST",
        CHAT,
        {"messages": USER, "top_logprobs": 2},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    (
        "prompt + max_tokens over context",
        "POST",
        CHAT,
        {"messages": USER, "max_tokens": 5000},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "prompt over context",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": "hello " * 3000}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "completions: two prompts",
        "POST",
        "/v1/completions",
        {"prompt": ["a", "b"]},
        400,
        "prompt",
        None,
    ),
    (
        "completions: missing prompt",
        "POST",
        "/v1/completions",
        {"max_tokens": 3},
        400,
        "prompt",
        "missing_required_parameter",
    ),
    (
        "completions: token id outside vocab",
        "POST",
        "/v1/completions",
        {"prompt": [1, 999999]},
        400,
        "prompt",
        None,
    ),
    (
        "completions: unknown model",
        "POST",
        "/v1/completions",
        {"model": "davinci-002", "prompt": "a"},
        404,
        "model",
        "model_not_found",
    ),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, None, "not_found"),
    ("wrong method", "DELETE", "/v1/models", None, 405, None, "method_not_allowed"),
    ("GET on a POST route", "GET", CHAT, None, 405, None, "method_not_allowed"),
    ("unknown model id", "GET", "/v1/models/gpt-4o", None, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(
    "method, path, body, status, param, code",
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_error_objects(
    llama_server: Server,
    method: str,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    http = llama_server.http()
    if isinstance(body, str):
        response = http.request(
            method, path, content=body, headers={"content-type": "application/json"}
        )
    else:
        response = http.request(method, path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    if code == "context_length_exceeded":
        assert str(CONTEXT) in error["message"]
        if param == "max_tokens":
            assert "5000" in error["message"]
    if status == 405:
        assert "allow" in response.headers


def test_form_encoded_body_is_a_clear_400(llama_server: Server) -> None:
    # curl -d without -H 'Content-Type: application/json'
    response = llama_server.http().post(
        CHAT,
        content=json.dumps({"messages": USER}),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 400
    assert "application/json" in response.json()["error"]["message"]


def test_edge_values_are_served_not_errors(llama_server: Server) -> None:
    """Odd but valid values must not reach the engine in a form that fails there."""
    client = llama_server.client()
    kwargs: dict[str, Any] = {"temperature": 1.0, "max_tokens": 6, "logit_bias": NO_EOS}
    # OpenAI seeds are signed: -1 is the same 64-bit seed as 2**64 - 1.
    negative = chat(client, seed=-1, **kwargs).choices[0].message.content
    assert negative == chat(client, seed=2**64 - 1, **kwargs).choices[0].message.content
    # top_k above the vocabulary size keeps every token.
    with_top_k = chat(client, seed=5, extra_body={"top_k": 10**6}, **kwargs)
    assert with_top_k.choices[0].message.content == (
        chat(client, seed=5, **kwargs).choices[0].message.content
    )
    for extra in ({"stop": ""}, {"stop": ["", "zz"]}, {"top_p": 0.0}, {"extra_body": {"min_p": 1}}):
        assert chat(client, **{**kwargs, **extra}).usage.completion_tokens >= 1
    empty = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": []}], max_tokens=2
    )
    assert empty.choices[0].finish_reason in ("stop", "length")


def test_sdk_raises_the_matching_errors(llama_server: Server) -> None:
    client = llama_server.client()
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, n=9)  # above max_batch
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, model="gpt-4o")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=CONTEXT * 2)
    assert info.value.code == "context_length_exceeded"
    # The server is still fine.
    assert chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")


# -- disconnects ----------------------------------------------------------------------

LONG = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": PROMPT}],
    "max_tokens": CONTEXT - 100,
    "temperature": 0,
    "logit_bias": NO_EOS,
}


def _cancelled_count(server: Server) -> int:
    return server.health().json()["stats"]["requests_cancelled"]


def _assert_cancelled_within(server: Server, before: int, seconds: float) -> None:
    start = time.monotonic()
    body = server.wait_idle(timeout=seconds)
    waited = time.monotonic() - start
    assert not body["busy"], f"worker still busy {waited:.1f}s after the disconnect"
    assert body["stats"]["requests_cancelled"] == before + 1
    assert waited < seconds


def test_streaming_disconnect_cancels_the_generation(llama_server: Server) -> None:
    before = _cancelled_count(llama_server)
    with (
        httpx.Client(base_url=llama_server.url, timeout=60) as http,
        http.stream("POST", CHAT, json={**LONG, "stream": True}) as response,
    ):
        assert response.status_code == 200
        # Keep the iterator referenced: a dropped one closes the connection early.
        lines = response.iter_lines()
        data: list[str] = []
        while len(data) < 4:
            line = next(lines)
            if line.startswith("data: "):
                data.append(line)
        assert llama_server.health().json()["busy"]
    # Leaving the block closed the connection mid-stream.
    _assert_cancelled_within(llama_server, before, 2.0)


def test_non_streaming_disconnect_cancels_the_generation(llama_server: Server) -> None:
    before = _cancelled_count(llama_server)
    timeout = httpx.Timeout(60, read=0.5)
    with (
        httpx.Client(base_url=llama_server.url, timeout=timeout) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        http.post(CHAT, json=LONG)
    _assert_cancelled_within(llama_server, before, 2.0)
    # And the next request is served normally.
    assert chat(llama_server.client(), max_tokens=3, logit_bias=NO_EOS).usage.completion_tokens == 3
