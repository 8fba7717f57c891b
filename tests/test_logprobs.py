"""logprobs, n > 1 and echo over HTTP (issue 18), with the official openai SDK.

One real uvicorn server (in this process, so that a test can script the tiny
model's output: tests/scripted.py) on a tiny llama with Qwen3's chat template,
max_batch 4 and no prompt cache, so that /health's prefill count is exact. The
logprobs it answers are checked against an independent mlx-lm forward over
the same model files, in float32.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import openai
import pytest
from mlx_lm.utils import load as mlx_lm_load

from .conftest import NO_EOS, Server
from .scripted import make_templated_model, script, scripted_server

MAX_BATCH = 4
MODEL = "tiny-qwen3"  # the model directory's name: the served id
USER = [{"role": "user", "content": "Tell me a story about a fox."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["capital"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_templated_model(tmp_path_factory.mktemp("logprobs") / MODEL, "qwen3")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    with scripted_server(model_dir, max_batch=MAX_BATCH) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    """mlx-lm's own load of the same files: the independent computation."""
    model, tokenizer = mlx_lm_load(str(model_dir))
    return model, tokenizer


def reference_logprobs(reference: Any, tokens: list[int]) -> mx.array:
    """log-softmax of mlx-lm's float32 logits at every position of `tokens`."""
    model, _ = reference
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, **kwargs)


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("prompt", "Once upon a time")
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 8)
    return client.completions.create(model=MODEL, **kwargs)


def prefilled(server: Server) -> int:
    return server.health().json()["stats"]["prefill_tokens_total"]


# -- logprobs ---------------------------------------------------------------------------


def test_chat_logprobs_greedy_streamed_and_not(client: openai.OpenAI) -> None:
    """The greedy token is the most likely one listed, its logprob the largest;
    every generated token is listed; streamed chunks carry the same logprobs."""
    response = chat(client, logprobs=True, top_logprobs=5, logit_bias=NO_EOS)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 5
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)
        assert entry.bytes == list(entry.token.encode()) or "\ufffd" in entry.token
    # The tokens' bytes are the text (the detokenizer drops a leading space).
    text = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")
    assert text.lstrip() == choice.message.content.lstrip()
    stream = chat(client, logprobs=True, top_logprobs=5, logit_bias=NO_EOS, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [
        (e.token, e.logprob, e.bytes) for e in content
    ]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in content
    ]
    # Without logprobs: none.
    assert chat(client).choices[0].logprobs is None


def test_completion_logprobs_greedy_streamed_and_not(client: openai.OpenAI) -> None:
    response = complete(client, logprobs=3, logit_bias=NO_EOS)
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 8
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 3 <= len(top) <= 4 and top[token] == value == max(top.values())
    # Offsets run over the tokens' texts, from the start of the choice's text.
    lengths = [len(t) for t in logprobs.tokens]
    assert logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    stream = complete(client, logprobs=3, logit_bias=NO_EOS, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [lp for c in chunks if c.logprobs for lp in zip(*_lists(c.logprobs), strict=True)]
    assert streamed == list(zip(*_lists(logprobs), strict=True))
    assert complete(client).choices[0].logprobs is None


def _lists(logprobs: Any) -> tuple[list, ...]:
    return (logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset)


def test_echo_scores_the_prompt_like_mlx_lm(client: openai.OpenAI, reference: Any) -> None:
    """What lm-evaluation-harness sends: echo, max_tokens 0, logprobs; the prompt's
    logprobs equal mlx-lm's log-softmax at each position (float32, 1e-4)."""
    _, tokenizer = reference
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    response = complete(client, prompt=prompt, echo=True, max_tokens=0, logprobs=1)
    choice = response.choices[0]
    assert choice.text == tokenizer.decode(prompt)
    assert choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), 0)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference_logprobs(reference, prompt)
    for position in range(1, len(prompt)):
        want = expected[position - 1][prompt[position]].item()
        assert logprobs.token_logprobs[position] == pytest.approx(want, abs=1e-4)
        best = max(logprobs.top_logprobs[position].values())
        assert best == pytest.approx(expected[position - 1].max().item(), abs=1e-4)


def test_generated_logprobs_match_mlx_lm(client: openai.OpenAI, reference: Any) -> None:
    """Greedy tokens after an echoed prompt: one logprobs list, prompt then completion,
    each value mlx-lm's over prompt + completion (no penalties or bias: the raw
    log-softmax)."""
    _, tokenizer = reference
    prompt = tokenizer.encode("A fox and a crow")
    # mlx-lm's own greedy continuation.
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(reference_logprobs(reference, tokens)[-1].argmax().item())
    response = complete(client, prompt=prompt, echo=True, max_tokens=6, logprobs=2)
    choice = response.choices[0]
    if response.usage.completion_tokens < 6:  # EOS was the greedy token: never listed
        tokens = tokens[: len(prompt) + response.usage.completion_tokens]
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(tokens[len(prompt) :])
    expected = reference_logprobs(reference, tokens)
    values = choice.logprobs.token_logprobs
    assert len(values) == len(tokens)
    for position in range(1, len(tokens)):
        want = expected[position - 1][tokens[position]].item()
        assert values[position] == pytest.approx(want, abs=1e-4)
    # The completion's offsets start where the echoed prompt's text ends.
    assert choice.logprobs.text_offset[len(prompt)] == len(tokenizer.decode(prompt))


def test_logprobs_in_a_batch_and_under_a_constraint(client: openai.OpenAI) -> None:
    """Concurrent requests, some with logprobs and some without, one constrained by a
    JSON schema: each gets its own, every listed value finite, greedy on top."""

    def one(i: int) -> Any:
        kwargs: dict[str, Any] = {
            "max_tokens": 12,
            "messages": [{"role": "user", "content": f"Say {i}"}],
        }
        if i % 2 == 0:
            kwargs.update(logprobs=True, top_logprobs=4)
        if i == 2:
            kwargs["response_format"] = ANSWER
        return chat(client, **kwargs)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(one, range(4)))
    for i, response in enumerate(responses):
        choice = response.choices[0]
        if i % 2:
            assert choice.logprobs is None
            continue
        assert len(choice.logprobs.content) == response.usage.completion_tokens
        for entry in choice.logprobs.content:
            assert all(math.isfinite(t.logprob) and t.logprob > -9999 for t in entry.top_logprobs)
            assert entry.top_logprobs[0].token == entry.token
    constrained = responses[2].choices[0]
    assert json.loads(constrained.message.content)["capital"] in ("Paris", "Rome", "Oslo")
    # Where the grammar allows one token only, one is listed (forbidden ones never are).
    assert any(len(e.top_logprobs) == 1 for e in constrained.logprobs.content)


# -- n choices --------------------------------------------------------------------------


def test_n_greedy_choices_are_identical_after_one_prefill(
    server: Server, client: openai.OpenAI
) -> None:
    single = chat(client, logit_bias=NO_EOS, messages=[{"role": "user", "content": "n=1"}])
    before = prefilled(server)
    response = chat(client, n=3, logit_bias=NO_EOS, messages=[{"role": "user", "content": "n=3"}])
    assert prefilled(server) - before == response.usage.prompt_tokens  # one prefill
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) == 1
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens
    assert response.usage.completion_tokens == 3 * 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24
    completion = complete(client, n=3, logprobs=0, prompt="Three times")
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({(c.text, tuple(c.logprobs.token_logprobs)) for c in completion.choices}) == 1


def test_seeded_choices_repeat_and_differ(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        response = chat(client, n=3, temperature=1.0, seed=1234, max_tokens=16, logit_bias=NO_EOS)
        return [c.message.content for c in response.choices]

    first, second = sample(), sample()
    assert first == second
    assert len(set(first)) > 1  # each choice draws its own stream (seed + index)


def test_n_streamed(client: openai.OpenAI) -> None:
    stream = chat(
        client,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: dict[int, list[str]] = {0: [], 1: [], 2: []}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes.values())
    whole = chat(client, n=3, temperature=1.0, seed=5, max_tokens=6)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    # /v1/completions likewise.
    stream = complete(client, n=2, max_tokens=4, stream=True)
    ends = [c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1]


def test_each_choice_parses_its_own_tool_calls(client: openai.OpenAI) -> None:
    """A scripted call in every choice (each with its own copy of the scripting
    processor and its own output parser); logprobs list every token, markup included."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    response = chat(client, n=2, tools=[WEATHER], max_tokens=60, logprobs=True, **script(call))
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        (tool_call,) = choice.message.tool_calls
        assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
        text = b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode()
        assert text == call
    assert response.usage.completion_tokens == 2 * len(response.choices[0].logprobs.content)
    stream = chat(client, n=2, tools=[WEATHER], max_tokens=60, stream=True, **script(call))
    names = {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                if delta.function and delta.function.name:
                    names[choice.index] = delta.function.name
    assert names == {0: "get_weather", 1: "get_weather"}


def test_n_with_a_constraint_gives_every_choice_its_grammar(client: openai.OpenAI) -> None:
    response = chat(client, n=3, temperature=1.0, seed=3, max_tokens=30, response_format=ANSWER)
    for choice in response.choices:
        assert json.loads(choice.message.content)["capital"] in ("Paris", "Rome", "Oslo")


# -- echo -------------------------------------------------------------------------------


def test_echo_streamed_and_not(client: openai.OpenAI) -> None:
    prompt = "Echo this prompt"
    whole = complete(client, prompt=prompt, echo=True, max_tokens=4)
    assert whole.choices[0].text.startswith(prompt)
    assert len(whole.choices[0].text) > len(prompt)
    chunks = [
        c.choices[0] for c in complete(client, prompt=prompt, echo=True, max_tokens=4, stream=True)
    ]
    assert chunks[0].text == prompt
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    # With logprobs and n: each choice's first chunk is the prompt with its logprobs.
    stream = complete(client, prompt=prompt, echo=True, max_tokens=2, logprobs=1, n=2, stream=True)
    first: dict[int, Any] = {}
    for chunk in stream:
        for choice in chunk.choices:
            first.setdefault(choice.index, choice)
    assert set(first) == {0, 1}
    for choice in first.values():
        assert choice.text == prompt
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.text_offset[0] == 0


# -- refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"n": MAX_BATCH + 1}, "n"),
        ("completions", {"n": MAX_BATCH + 1}, "n"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"echo": 1}, "echo"),
    ],
)
def test_bad_values_are_400_naming_the_field(
    server: Server, endpoint: str, body: dict[str, Any], param: str
) -> None:
    http = server.http()
    if endpoint == "chat":
        response = http.post("/v1/chat/completions", json={"messages": USER, **body})
    else:
        response = http.post("/v1/completions", json={"prompt": "a", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
