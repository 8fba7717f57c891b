"""Prompt cache, memory tier: a prompt starts from its longest cached prefix.

Greedy output with a cache hit must be token-identical to a cold run (this
process runs on the reference BLAS), for attention KV (llama, qwen3_moe) and
recurrent state (qwen3_next), resident and streamed, alone and in a batch.
A diverging prompt reuses exactly the common prefix, never more.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.prepare import prepare

from .conftest import NO_EOS, metric, start_server, stop_server
from .scripted import make_templated_model, script, scripted_server

BASE = list(range(5, 45))  # 40 tokens
GROWN = BASE + list(range(50, 70))  # the next turn: the same 40, then 20 more
DIVERGED = [*BASE[:20], 99, 98, *BASE[22:], 7, 8]  # differs from token 20 on
NO_EOS_BIAS = {int(k): v for k, v in NO_EOS.items()}


def common(prompt: list[int], entry: list[int]) -> int:
    """Tokens of `prompt` a cached `entry` can serve: the common prefix, never the last token."""
    n = 0
    while n < min(len(prompt), len(entry)) and prompt[n] == entry[n]:
        n += 1
    return min(n, len(prompt) - 1)


def _engine(model: Path, **config) -> Engine:
    engine = Engine(EngineConfig(model=str(model), **config))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    return engine


async def _one(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    handle = engine.submit(
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=10,
            sampling=SamplingParams(temperature=0.0, logit_bias=NO_EOS_BIAS),
        )
    )
    tokens, cached = [], -1
    async for event in handle:
        if isinstance(event, TokenEvent):
            tokens.append(event.token)
        elif isinstance(event, DoneEvent):
            cached = event.cached_tokens
        elif isinstance(event, ErrorEvent):
            raise AssertionError(event.message)
    return tokens, cached


def _in_turn(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    async def run() -> list[tuple[list[int], int]]:
        return [await _one(engine, p) for p in prompts]

    return asyncio.run(run())


def _together(engine: Engine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    async def run() -> list[tuple[list[int], int]]:
        return list(await asyncio.gather(*(_one(engine, p) for p in prompts)))

    return asyncio.run(run())


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next"])
def test_hits_are_token_identical_to_cold_runs(cache_arch_dirs: dict[str, Path], arch: str):
    cold = _engine(cache_arch_dirs[arch])
    warm = _engine(cache_arch_dirs[arch], prompt_cache_bytes=1 << 30)
    try:
        expected = _in_turn(cold, [BASE, GROWN, DIVERGED])
        got = _in_turn(warm, [BASE, GROWN, DIVERGED])
        snapshot = warm.prompt_cache.snapshot()
    finally:
        cold.shutdown()
        warm.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert all(cached == 0 for _, cached in expected)  # no cache: nothing reused
    # BASE's states are stored after its first 39 tokens and after its answer.
    # Attention KV is trimmed back to the common prefix (all of BASE); recurrent
    # state cannot be trimmed: GROWN starts from BASE[:-1], the diverged prompt cold.
    trims = arch != "qwen3_next"
    assert [cached for _, cached in got] == [
        0,
        len(BASE) if trims else len(BASE) - 1,
        20 if trims else 0,
    ]
    assert snapshot["hits"] == (2 if trims else 1)
    assert snapshot["tokens_reused"] == sum(cached for _, cached in got)
    assert snapshot["memory"]["entries"] >= 1 and snapshot["memory"]["bytes"] > 0


def test_hits_inside_a_batch_match_solo_cold_runs(cache_arch_dirs: dict[str, Path]):
    cold = _engine(cache_arch_dirs["llama"])
    warm = _engine(cache_arch_dirs["llama"], prompt_cache_bytes=1 << 30, max_batch=4)
    try:
        prompts = [GROWN, DIVERGED, [*BASE, 3]]
        expected = _in_turn(cold, prompts)
        ((base_answer, _),) = _in_turn(warm, [BASE])  # stores BASE[:-1], then BASE + answer
        got = _together(warm, prompts)
    finally:
        cold.shutdown()
        warm.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    # BASE and its answer are cached: each prompt reuses what it shares with them.
    answered = BASE + base_answer
    assert [cached for _, cached in got] == [common(p, answered) for p in prompts]


@pytest.mark.parametrize(
    ("arch", "knobs"),
    [("llama", {"resident_layers": 0}), ("qwen3_moe", {"resident_layers": 0, "expert_cache": "6"})],
)
def test_streamed_and_expert_cache_hits_match_resident_cold(
    cache_arch_dirs: dict[str, Path], tmp_path: Path, arch: str, knobs: dict
):
    prepared = prepare(str(cache_arch_dirs[arch]), tmp_path / "prepared", expert_bits=4)
    cold = _engine(prepared)  # every layer and expert resident
    warm = _engine(prepared, prompt_cache_bytes=1 << 30, **knobs)
    try:
        expected = _in_turn(cold, [BASE, GROWN])
        got = _in_turn(warm, [BASE, GROWN])
    finally:
        cold.shutdown()
        warm.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    assert got[1][1] == len(BASE)


def test_pressure_releases_oldest_entries(cache_arch_dirs: dict[str, Path]):
    warm = _engine(cache_arch_dirs["llama"], prompt_cache_bytes=1 << 30)
    try:
        _in_turn(warm, [BASE, [9, *BASE[1:]], [8, *BASE[1:]]])
        cache = warm.prompt_cache
        before, entries = cache.nbytes, cache.entries
        freed = cache.shrink(1)
        assert entries == 3 and 0 < freed < before
        assert cache.entries == 2 and cache.nbytes == before - freed
        # The oldest entry (BASE) went first: BASE is a miss again.
        assert _in_turn(warm, [[*BASE, 3]])[0][1] == 0
        assert cache.snapshot()["memory"]["released_bytes"] == freed
    finally:
        warm.shutdown()


def test_a_small_budget_keeps_the_newest_entries(cache_arch_dirs: dict[str, Path]):
    warm = _engine(cache_arch_dirs["llama"], prompt_cache_bytes=1 << 30)
    try:
        _in_turn(warm, [BASE])
        one_entry = warm.prompt_cache.nbytes
    finally:
        warm.shutdown()
    small = _engine(cache_arch_dirs["llama"], prompt_cache_bytes=one_entry + one_entry // 2)
    try:
        got = _in_turn(small, [BASE, [9, *BASE[1:]], [9, *BASE[1:], 3], [*BASE, 3]])
        assert small.prompt_cache.nbytes <= one_entry + one_entry // 2
    finally:
        small.shutdown()
    assert [cached for _, cached in got] == [0, 0, len(BASE), 0]


# -- through the server --------------------------------------------------------------


def test_server_reports_cached_tokens_stats_memory_and_metrics(
    tiny_llama_dir: Path, tmp_path: Path
):
    server = start_server(tiny_llama_dir, tmp_path, "--prompt-cache-bytes", "64MB")
    try:
        http = server.http()

        def complete(prompt: list[int], **extra) -> dict:
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        first = complete(BASE)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert complete(GROWN)["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        assert complete(DIVERGED)["usage"]["prompt_tokens_details"]["cached_tokens"] == 20

        # Chat: the next turn resends the conversation; the rendered first turn is reused.
        client = server.client()
        messages = [{"role": "user", "content": "Tell me about disks."}]
        turn1 = client.chat.completions.create(
            model=server.model_id, messages=messages, max_tokens=4, temperature=0
        )
        messages += [
            {"role": "assistant", "content": turn1.choices[0].message.content},
            {"role": "user", "content": "And about memory?"},
        ]
        stream = client.chat.completions.create(
            model=server.model_id,
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
        # At least turn 1's prompt: its answer too, where it renders back to the same tokens.
        cached = usage.prompt_tokens_details.cached_tokens
        assert turn1.usage.prompt_tokens <= cached < usage.prompt_tokens

        stats = http.get("/cache/stats").json()["prompt_cache"]
        assert stats["hits"] == 3 and stats["misses"] == 2
        assert stats["tokens_reused"] == 40 + 20 + cached
        memory = stats["memory"]
        assert 0 < memory["bytes"] <= memory["max_bytes"] == 64_000_000
        assert http.get("/memory").json()["prompt_cache_bytes"] == memory["bytes"]
        metrics = http.get("/metrics").text
        assert metric(metrics, "flashserve_prompt_cache_hits_total") == 3.0
        assert metric(metrics, "flashserve_prompt_cache_memory_bytes") == memory["bytes"]
        assert metric(metrics, "flashserve_prompt_cache_disk_bytes_written_total") is not None
    finally:
        stop_server(server)


def test_test_servers_run_cold_unless_asked(llama_server):
    http = llama_server.http()
    body = {"prompt": BASE, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        usage = http.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert http.get("/cache/stats").json()["prompt_cache"] is None


def test_diverging_conversations_reuse_exactly_the_common_prefix(tmp_path: Path):
    """Qwen3's template drops past reasoning; a client moves the system message.

    Each turn's prompt tokens, rendered here with the model's own tokenizer,
    against every state the cache holds (each prompt, and each prompt with
    its answer): cached_tokens is the longest common prefix, never more.
    """
    from transformers import AutoTokenizer

    model = make_templated_model(tmp_path / "qwen3", "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def render(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    thought = "<think>\nSum the two numbers.\n</think>\n\n"
    ask = [{"role": "user", "content": "What is 2 + 2?"}]
    turns = [
        (ask, f"{thought}The answer is 4."),
        # The answer comes back without its reasoning: the template drops it.
        (
            [
                *ask,
                {"role": "assistant", "content": "The answer is 4."},
                {"role": "user", "content": "And 3 + 3?"},
            ],
            "It is 6.",
        ),
        # A system message inserted in front: little is shared any more.
        ([{"role": "system", "content": "Be brief."}, *ask], "4."),
        ([*ask, {"role": "system", "content": "Be brief."}], "Four."),
    ]
    stored: list[list[int]] = []
    with scripted_server(model, prompt_cache_bytes=64_000_000) as server:
        client = server.client()
        for messages, reply in turns:
            prompt = render(messages)
            response = client.chat.completions.create(
                model=server.model_id, messages=messages, max_tokens=40, **script(reply)
            )
            assert response.usage.prompt_tokens == len(prompt)
            want = max((common(prompt, entry) for entry in stored), default=0)
            assert response.usage.prompt_tokens_details.cached_tokens == want
            answer = tokenizer.encode(reply, add_special_tokens=False)
            stored += [prompt[:-1], prompt + answer + [eos]]
    assert want > 0  # the last turn shares the conversation's start


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_prompts_state_serves_a_second_request_while_the_first_still_answers(
    cache_arch_dirs: dict[str, Path], arch: str
):
    """BASE[:-1]'s state is stored once the first request's first token is out
    (attention KV, cut back from the live cache), or at its prompt's end
    (recurrent state, which cannot be cut back); a second request with the same
    prompt, sent while the first still generates, starts from it and answers
    what a cold run answers."""
    cold = _engine(cache_arch_dirs[arch])
    warm = _engine(cache_arch_dirs[arch], prompt_cache_bytes=1 << 30, max_batch=4)

    async def overlapping() -> tuple[list[int], tuple[list[int], int]]:
        long = warm.submit(
            GenerationRequest(
                prompt_tokens=BASE,
                max_tokens=40,
                sampling=SamplingParams(temperature=0.0, logit_bias=NO_EOS_BIAS),
            )
        )
        first: list[int] = []
        async for event in long:
            if isinstance(event, TokenEvent):
                first.append(event.token)
                if len(first) == 2:
                    break
        second = await _one(warm, BASE)
        long.cancel()
        return first, second

    try:
        ((expected, _),) = _in_turn(cold, [BASE])
        first, (tokens, cached) = asyncio.run(overlapping())
    finally:
        cold.shutdown()
        warm.shutdown()
    assert first == expected[:2]
    assert tokens == expected
    assert cached == len(BASE) - 1
