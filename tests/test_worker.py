"""The generation worker on a real tiny model: events, stops, seeds, isolation."""

import asyncio

import mlx.core as mx
import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.stops import StopMatcher
from flashserve.engine.generation.worker import Engine, QueueFullError
from flashserve.engine.weights.synthetic import make_model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("worker") / "llama", "llama")
    eng = Engine(EngineConfig(model=str(path), max_queue=4, max_batch=2))
    eng.start()
    assert eng.wait_ready(60), eng.load_error
    yield eng
    eng.shutdown()


def prompt(engine, text="hello"):
    return engine.loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def run(engine, request, cancel_after=None):
    async def go():
        handle = engine.submit(request)
        events = []
        async for event in handle:
            events.append(event)
            if cancel_after is not None and len(events) == cancel_after:
                handle.cancel()
        return events

    return asyncio.run(go())


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, (TokenEvent, DoneEvent)))


def greedy(engine, max_tokens=16, **kw):
    return GenerationRequest(prompt(engine), max_tokens, SamplingParams(temperature=0), **kw)


def test_greedy_matches_plain_mlx_lm(engine):
    from mlx_lm.generate import generate_step

    events = run(engine, greedy(engine))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length"
    assert done.completion_tokens == 16 == len(events) - 1
    tokens = [e.token for e in events[:-1]]
    steps = generate_step(mx.array(prompt(engine)), engine.loaded.model, max_tokens=16)
    assert tokens == [t for t, _ in steps]


def test_stop_string_is_cut_and_not_emitted(engine):
    full = text_of(run(engine, greedy(engine, max_tokens=24)))
    stop = full[5:8]
    assert len(stop) == 3
    events = run(engine, greedy(engine, max_tokens=24, stop=[stop]))
    assert events[-1].finish_reason == "stop"
    assert text_of(events) == full[: full.index(stop)]


def test_same_seed_same_text(engine):
    def sampled(seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        return [e.token for e in run(engine, GenerationRequest(prompt(engine), 12, params))[:-1]]

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8) or sampled(7) != sampled(9)


def test_cancel_stops_within_a_token(engine):
    events = run(engine, greedy(engine, max_tokens=200), cancel_after=3)
    assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "cancelled"
    assert len(events) <= 5
    assert engine.idle


def test_failing_generation_reports_error_and_worker_keeps_serving(engine):
    def broken(tokens, logits):
        raise RuntimeError("boom")

    events = run(engine, greedy(engine, logits_processors=[broken]))
    assert isinstance(events[-1], ErrorEvent) and "boom" in events[-1].message
    assert run(engine, greedy(engine))[-1].finish_reason == "length"


def test_queue_bound(engine):
    async def burst():
        handles = []
        with pytest.raises(QueueFullError):
            for _ in range(10):
                handles.append(engine.submit(greedy(engine, max_tokens=50)))
        for h in handles:
            h.cancel()
        for h in handles:
            async for _ in h:
                pass

    asyncio.run(burst())


@pytest.mark.parametrize(
    "pieces, stops, expected",
    [
        (["hel", "lo E", "N", "D tail"], ["END"], "hello "),
        (["aE", "Nb"], ["END"], "aENb"),
        (["x", "y"], [], "xy"),
        (["abc"], ["b", "c"], "a"),
    ],
)
def test_stop_matcher(pieces, stops, expected):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces) + m.flush()
    assert out == expected
