"""The prompt cache's disk writer stays out of the requests' way.

A state's write is mostly CPU (its checksum, the copy into the page cache), so
the writer thread runs at the lowest priority and waits, between pieces of a
state, while some engine prefills a prompt (prompt_cache/background.py), up to
MAX_PAUSE_S a state. Here with a real disk tier, the real prefill flag
(generation/fairness.py's board) and a real engine's prefill.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation import fairness
from flashserve.engine.generation.requests import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.prompt_cache import background
from flashserve.engine.prompt_cache.disk import DiskTier

from .test_prompt_disk_race import PROMPT, _state


def _written(tier: DiskTier, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while tier.stats.written == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return tier.stats.written


@pytest.fixture
def prefill_running():
    """Another engine's prompt prefilling, as its worker tells the board."""
    with fairness.board.cond:
        fairness.board.prefilling[-1] = time.monotonic()
    try:
        yield
    finally:
        with fairness.board.cond:
            fairness.board.prefilling.pop(-1, None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_the_writer_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "bg-model")
    try:
        deadline = time.monotonic() + 5
        nice = None
        while time.monotonic() < deadline:
            nice = os.getpriority(os.PRIO_PROCESS, tier._writer.native_id)
            if nice == background.WRITER_NICE:
                break
            time.sleep(0.01)
        assert nice == background.WRITER_NICE
        # The rest of the process keeps its own.
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != background.WRITER_NICE
    finally:
        tier.close()


def test_a_write_waits_while_a_prompt_prefills(
    tiny_llama_dir: Path, tmp_path: Path, prefill_running
) -> None:
    from flashserve.engine.prompt_cache.cache import PromptCache

    model, _ = mlx_load(str(tiny_llama_dir))
    tier = DiskTier(tmp_path, 1 << 30, "bg-model")
    cache = PromptCache(1 << 30, "bg-model", disk=tier)
    try:
        cache.store(PROMPT, _state(model, PROMPT))
        assert _written(tier, 0.6) == 0  # held while the prefill runs
        with fairness.board.cond:
            fairness.board.prefilling.pop(-1)
        assert _written(tier, 10) == 1
        # What was written is the state, read back from disk alone.
        fresh = PromptCache(0, "bg-model", disk=DiskTier(tmp_path, 1 << 30, "bg-model"))
        state, reused = fresh.fetch([*PROMPT, 99])
        assert reused == len(PROMPT)
        want = _state(model, PROMPT)
        for got, ref in zip(state, want, strict=True):
            n = ref.offset
            assert mx.array_equal(got.keys[..., :n, :], ref.keys[..., :n, :])
            assert mx.array_equal(got.values[..., :n, :], ref.values[..., :n, :])
        fresh.disk.close()
    finally:
        tier.close()


def test_a_write_waits_at_most_max_pause(
    tiny_llama_dir: Path, tmp_path: Path, prefill_running, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashserve.engine.prompt_cache.cache import PromptCache

    monkeypatch.setattr(background, "MAX_PAUSE_S", 0.5)
    model, _ = mlx_load(str(tiny_llama_dir))
    tier = DiskTier(tmp_path, 1 << 30, "bg-model")
    cache = PromptCache(1 << 30, "bg-model", disk=tier)
    try:
        start = time.monotonic()
        cache.store(PROMPT, _state(model, PROMPT))
        assert _written(tier, 10) == 1  # the prefill still runs
        assert time.monotonic() - start >= 0.4
    finally:
        tier.close()


def test_an_engines_prefill_is_what_the_writer_waits_for(tiny_llama_dir: Path) -> None:
    """While a real engine prefills a prompt, the writer's probe says so; while it
    decodes, not."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), prompt_cache_disk_bytes=0))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    model = engine.loaded.model
    seen: list[tuple[int, bool]] = []
    real = type(model).__call__

    def spy(self, inputs, *args, **kwargs):
        if self is model:
            seen.append((inputs.shape[1], background._probe.prefilling()))
        return real(self, inputs, *args, **kwargs)

    type(model).__call__ = spy
    try:

        async def run() -> list[int]:
            greedy = SamplingParams(temperature=0.0)
            handle = engine.submit(GenerationRequest(PROMPT, 4, greedy, use_prompt_cache=False))
            return [e.token async for e in handle if isinstance(e, TokenEvent)]

        tokens = asyncio.run(run())
    finally:
        type(model).__call__ = real
        engine.shutdown()
    assert tokens
    prompt_calls = [busy for rows, busy in seen if rows > 1]
    decode_calls = [busy for rows, busy in seen[1:] if rows == 1]
    assert prompt_calls and all(prompt_calls)
    assert decode_calls and not decode_calls[-1]


def test_a_prefill_whose_step_failed_leaves_no_mark(tiny_llama_dir: Path) -> None:
    """A prompt whose prefill step fails (the request gets the error, the batch is
    replaced) is not left marked as prefilling: the disk writer and other engines do
    not wait for it until the next prompt, nor the next request's decode steps."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), prompt_cache_disk_bytes=0))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    model = engine.loaded.model
    seen: list[tuple[int, bool]] = []
    failed: list[int] = []
    real = type(model).__call__

    def spy(self, inputs, *args, **kwargs):
        if self is model:
            if inputs.shape[1] > 1 and not failed:
                failed.append(inputs.shape[1])
                raise RuntimeError("a prefill step that fails")
            seen.append((inputs.shape[1], background._probe.prefilling()))
        return real(self, inputs, *args, **kwargs)

    type(model).__call__ = spy
    try:

        async def run() -> list[Any]:
            greedy = SamplingParams(temperature=0.0)
            handle = engine.submit(GenerationRequest(PROMPT, 4, greedy, use_prompt_cache=False))
            return [e async for e in handle]

        first = asyncio.run(run())
        marked = dict(fairness.board.prefilling)  # before any other step
        second = asyncio.run(run())
    finally:
        type(model).__call__ = real
        engine.shutdown()
    assert failed and any(isinstance(e, ErrorEvent) for e in first)
    assert not marked
    assert [e for e in second if isinstance(e, TokenEvent)]
    decode_calls = [busy for rows, busy in seen if rows == 1]
    assert decode_calls and not any(decode_calls[1:])
    assert not fairness.board.prefilling


def test_a_write_someone_waits_for_does_not_pause(
    tiny_llama_dir: Path, tmp_path: Path, prefill_running
) -> None:
    """Disk only, a lookup waits for its own state to land while its worker's
    prefill is on the board: the writer goes on (else both would wait it out)."""
    from flashserve.engine.prompt_cache import files as prompt_files

    model, _ = mlx_load(str(tiny_llama_dir))
    tier = DiskTier(tmp_path, 1 << 30, "bg-model")
    try:
        entry = prompt_files.prepare(PROMPT, _state(model, PROMPT))
        tier.put(entry)
        start = time.monotonic()
        assert tier.wait_written(entry, 5.0)
        assert time.monotonic() - start < background.MAX_PAUSE_S / 2
        assert tier.stats.written == 1
    finally:
        tier.close()


def test_a_tier_that_must_not_yield_writes_at_once(
    tiny_llama_dir: Path, tmp_path: Path, prefill_running
) -> None:
    """Under a memory plan a queued state holds its bytes until written: that tier
    keeps its priority and writes while prompts prefill."""
    from flashserve.engine.prompt_cache.cache import PromptCache

    model, _ = mlx_load(str(tiny_llama_dir))
    tier = DiskTier(tmp_path, 1 << 30, "bg-model", yield_to_prefills=False)
    cache = PromptCache(1 << 30, "bg-model", disk=tier)
    try:
        cache.store(PROMPT, _state(model, PROMPT))
        assert _written(tier, 2.0) == 1
        if sys.platform.startswith("linux"):
            assert os.getpriority(os.PRIO_PROCESS, tier._writer.native_id) == os.getpriority(
                os.PRIO_PROCESS, threading.get_native_id()
            )
    finally:
        tier.close()
