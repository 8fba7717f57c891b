"""Continuous batching: requests decoded together give what they give alone."""

import asyncio

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
from flashserve.engine.weights.synthetic import make_model_dir

QUESTIONS = ["hi", "What is the capital of France?", "tell me a story about a fox", "x y z"]


def make_engine(path, **kw):
    eng = Engine(EngineConfig(model=str(path), **kw))
    eng.start()
    assert eng.wait_ready(60), eng.load_error
    return eng


def engine_for(arch, residency, tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("batch") / arch, arch)
    knobs = {}
    if residency == "0%":
        path = prepare(str(path), tmp_path_factory.mktemp("batch-prepared") / arch)
        knobs = {"residency": "fixed", "resident_layers": 0}
    eng = make_engine(path, max_batch=4, **knobs)
    if residency == "0%":
        assert eng.loaded.streamer.resident_layers == []
    return eng


@pytest.fixture(
    scope="module",
    params=[("llama", "resident"), ("qwen3_moe", "resident"), ("llama", "0%"), ("qwen3_moe", "0%")],
    ids=lambda p: "-".join(p),
)
def engine(request, tmp_path_factory):
    eng = engine_for(*request.param, tmp_path_factory)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def streamed_engine(request, tmp_path_factory):
    eng = engine_for(request.param, "0%", tmp_path_factory)
    yield eng
    eng.shutdown()


def req(engine, question, max_tokens=20, **kw):
    prompt = engine.loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    return GenerationRequest(prompt, max_tokens, SamplingParams(temperature=0), **kw)


async def collect(engine, request, cancel_after=None, delay=0.0):
    await asyncio.sleep(delay)
    handle = engine.submit(request)
    events = []
    async for event in handle:
        events.append(event)
        if cancel_after is not None and len(events) == cancel_after:
            handle.cancel()
    return events


def tokens(events):
    return [e.token for e in events if isinstance(e, TokenEvent)]


def alone(engine, requests):
    return [asyncio.run(collect(engine, r)) for r in requests]


def test_batched_greedy_equals_alone(engine):
    requests = [req(engine, q, max_tokens=12 + 4 * i) for i, q in enumerate(QUESTIONS)]
    solo = alone(engine, requests)

    async def together():
        # Staggered: later requests join a batch that is already decoding.
        return await asyncio.gather(
            *(collect(engine, r, delay=0.05 * i) for i, r in enumerate(requests))
        )

    batched = asyncio.run(together())
    assert engine.stats.steps > 0
    for s, b in zip(solo, batched, strict=True):
        assert tokens(b) == tokens(s)
        assert b[-1].finish_reason == s[-1].finish_reason == "length"


def test_cancel_mid_batch_leaves_others_intact(engine):
    keep = [req(engine, QUESTIONS[1], 24), req(engine, QUESTIONS[2], 24)]
    solo = alone(engine, keep)

    async def together():
        return await asyncio.gather(
            collect(engine, keep[0]),
            collect(engine, req(engine, QUESTIONS[0], 200), cancel_after=3),
            collect(engine, keep[1]),
        )

    a, cancelled, b = asyncio.run(together())
    assert cancelled[-1].finish_reason == "cancelled"
    assert tokens(a) == tokens(solo[0]) and tokens(b) == tokens(solo[1])


def test_different_limits_and_stops_finish_independently(engine):
    full = asyncio.run(collect(engine, req(engine, QUESTIONS[1], 24)))
    text = "".join(e.text for e in full if not isinstance(e, ErrorEvent))
    stop = text[4:7]

    async def together():
        return await asyncio.gather(
            collect(engine, req(engine, QUESTIONS[1], 24, stop=[stop])),
            collect(engine, req(engine, QUESTIONS[2], 5)),
            collect(engine, req(engine, QUESTIONS[3], 30)),
        )

    stopped, short, long = asyncio.run(together())
    assert stopped[-1].finish_reason == "stop"
    assert "".join(e.text for e in stopped) == text[: text.index(stop)]
    assert short[-1].finish_reason == "length" and short[-1].completion_tokens == 5
    assert long[-1].completion_tokens == 30


def test_failing_request_in_batch_fails_alone(engine):
    def broken(tokens, logits):
        raise RuntimeError("boom")

    good = req(engine, QUESTIONS[2], 16)
    solo = alone(engine, [good])[0]

    async def together():
        return await asyncio.gather(
            collect(engine, good), collect(engine, req(engine, "a", 16, logits_processors=[broken]))
        )

    ok, bad = asyncio.run(together())
    assert isinstance(bad[-1], ErrorEvent) and "boom" in bad[-1].message
    assert tokens(ok) == tokens(solo) and isinstance(ok[-1], DoneEvent)


def test_streamed_layers_load_once_per_step_for_the_batch(streamed_engine):
    engine = streamed_engine
    streamer = engine.loaded.streamer

    def loads_for(n_requests):
        before = streamer.stats.layer_loads

        async def together():
            return await asyncio.gather(
                *(collect(engine, req(engine, QUESTIONS[i], 16)) for i in range(n_requests))
            )

        asyncio.run(together())
        return streamer.stats.layer_loads - before

    alone_loads = loads_for(1)
    batch_loads = loads_for(3)
    # three sequences share each step's reads: far fewer than three times the loads
    assert batch_loads < 1.5 * alone_loads
