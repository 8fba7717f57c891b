"""A resident model's decode step as one compiled function (engine/generation/decode_step.py).

The compiled step must be the uncompiled one to the bit. Real architectures
(tiny random weights, 4-bit, flashserve's kernel and step ops) decode through
mlx-lm's BatchGenerator, as the worker runs it: sequences of different
lengths (left padding), one joining mid-way and one leaving early, and past a
growth of the key buffers (256 keys). Every step's log-probabilities must be
equal, not close. Then the engine serving the default model gives the same
tokens with the setting on and off.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from flashserve.engine.compute import qmm, step_ops
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation import decode_step
from flashserve.engine.generation.requests import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.sources import load_plain
from flashserve.engine.weights.synthetic import make_model_dir


@pytest.fixture(autouse=True)
def fast_path():
    assert qmm.select("fast") == "fast"  # this machine has the kernel: CI builds it
    step_ops.install()
    yield
    qmm.select("auto")


def decode(model, prompts: list[list[int]], lengths: list[int], join_at: int) -> dict:
    """Greedy decode; the last prompt joins after `join_at` steps. uid -> (tokens, logprobs)."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    out: dict[int, tuple[list[int], list[mx.array]]] = {}
    gen.insert(prompts[:-1], max_tokens=lengths[:-1])
    steps = 0
    while True:
        if steps == join_at:
            gen.insert(prompts[-1:], max_tokens=lengths[-1:])
        _, responses = gen.next()
        if not responses and steps > join_at:
            break
        for r in responses:
            tokens, logprobs = out.setdefault(r.uid, ([], []))
            tokens.append(r.token)
            logprobs.append(r.logprobs)
        steps += 1
    gen.close()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "gemma3_text"])
def test_compiled_steps_decode_to_the_bit_what_uncompiled_steps_do(arch, tmp_path: Path):
    path = make_model_dir(tmp_path / arch, arch, quantize_bits=4, group_size=32)
    model, _, _ = load_plain(path)
    qmm.use_fast_qmm(model)
    step_ops.install()  # the model's module was imported just now
    # Lengths 3, 11 and 6: left padding in the batch. The first runs past 256
    # keys (the buffers grow), the second leaves early, the third joins late.
    prompts = [[5, 9, 13], [7, 3, 11, 2, 8, 4, 6, 10, 12, 14, 1], [9, 9, 2, 5, 7, 3]]
    lengths = [270, 30, 40]
    plain = decode(model, prompts, lengths, join_at=12)
    compiled_model = decode_step.CompiledDecode(model)
    compiled = decode(compiled_model, prompts, lengths, join_at=12)
    assert sorted(len(t) for t, _ in plain.values()) == sorted(lengths)
    assert plain.keys() == compiled.keys()
    for uid, (tokens, logprobs) in plain.items():
        got_tokens, got_logprobs = compiled[uid]
        assert got_tokens == tokens, uid
        for step, (got, want) in enumerate(zip(got_logprobs, logprobs, strict=True)):
            assert mx.array_equal(got, want).item(), (uid, step)
    assert not compiled_model.failed
    if arch == "gemma3_text":
        # Sliding-window layers keep rotating caches: every step stays uncompiled.
        assert compiled_model.steps == 0
    else:
        assert compiled_model.steps >= lengths[0] - 2  # every decode step but the first


def engine_tokens(config: EngineConfig, prompts: list[str], tokens: int) -> tuple[list, list]:
    """Each prompt's greedy tokens, decoded concurrently; and the models the batches called."""
    called: list = []
    for_model = decode_step.for_model

    def spy(model, *, compile: bool, streamer=None):
        called.append(for_model(model, compile=compile, streamer=streamer))
        return called[-1]

    decode_step.for_model = spy
    engine = Engine(config)
    try:
        engine.start()
        assert engine.wait_ready(timeout=300)
        tokenizer = engine.loaded.tokenizer

        async def one(text: str) -> list[int]:
            request = GenerationRequest(tokenizer.encode(text), tokens, SamplingParams(0.0))
            out = []
            async for event in engine.submit(request):
                assert not isinstance(event, ErrorEvent), event
                if isinstance(event, TokenEvent):
                    out.append(event.token)
            return out

        async def all_of() -> list[list[int]]:
            return await asyncio.gather(*(one(p) for p in prompts))

        return asyncio.run(all_of()), called
    finally:
        decode_step.for_model = for_model
        engine.shutdown()


def test_the_engine_decodes_the_default_model_the_same_with_the_setting_on_and_off():
    prompts = ["Fox 0:", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    on, models_on = engine_tokens(EngineConfig(model=None, max_batch=4), prompts, 48)
    off, models_off = engine_tokens(
        EngineConfig(model=None, max_batch=4, compile_decode=False), prompts, 48
    )
    assert on == off
    assert all(len(t) == 48 for t in on)
    assert isinstance(models_on[0], decode_step.CompiledDecode) and models_on[0].steps > 40
    assert not any(isinstance(m, decode_step.CompiledDecode) for m in models_off)


def test_few_traces_kept_still_decode_to_the_bit(tmp_path: Path, monkeypatch):
    """Batch sizes 2, 3, 2, 1 and two capacities with one trace kept: retraced, same bits."""
    monkeypatch.setattr(decode_step, "MAX_TRACES", 1)
    path = make_model_dir(tmp_path / "llama", "llama", quantize_bits=4, group_size=32)
    model, _, _ = load_plain(path)
    qmm.use_fast_qmm(model)
    step_ops.install()
    prompts = [[5, 9, 13], [7, 3, 11, 2], [9, 9, 2, 5, 7, 3]]
    lengths = [262, 20, 30]
    plain = decode(model, prompts, lengths, join_at=5)
    compiled_model = decode_step.CompiledDecode(model)
    compiled = decode(compiled_model, prompts, lengths, join_at=5)
    for uid, (tokens, logprobs) in plain.items():
        assert compiled[uid][0] == tokens
        pairs = zip(compiled[uid][1], logprobs, strict=True)
        assert all(mx.array_equal(a, b).item() for a, b in pairs)
    assert len(compiled_model._fns) == 1 and compiled_model.steps > 250


class Peeking:
    """A model that reads an array's value in Python while it runs: no trace can hold that."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        if cache:
            cache[0].offset.max().item()
        return self.model(inputs, cache=cache)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def test_a_model_the_trace_cannot_take_decodes_uncompiled_and_the_same(tmp_path: Path):
    path = make_model_dir(tmp_path / "llama", "llama", quantize_bits=4, group_size=32)
    model, _, _ = load_plain(path)
    qmm.use_fast_qmm(model)
    step_ops.install()
    prompts = [[5, 9, 13], [7, 3, 11, 2], [9, 9, 2]]
    lengths = [12, 8, 6]
    plain = decode(model, prompts, lengths, join_at=3)
    compiled_model = decode_step.CompiledDecode(Peeking(model))
    got = decode(compiled_model, prompts, lengths, join_at=3)
    assert compiled_model.failed and compiled_model.steps == 0
    assert {uid: t for uid, (t, _) in got.items()} == {uid: t for uid, (t, _) in plain.items()}
