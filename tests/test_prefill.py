"""Layer-major and expert-major prefill of models whose weights come from disk.

Greedy output must be token-identical to mlx-lm's chunked prefill and to the
fully resident model (this process runs on the reference BLAS), for attention
KV (llama, qwen3_moe) and recurrent state (qwen3_next), alone and with two
prompts prefilled together. A streamed layer is read once per prefill, an
expert at most once per prefill and layer, and a prefill never evicts what
decode keeps in the expert cache.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.model import compute_dtype
from flashserve.engine.weights.prepare import prepare

from .conftest import NO_EOS, start_server, stop_server

LONG = [(7 * i) % 250 + 5 for i in range(300)]  # 5 chunks of 64, the last token apart
OTHER = [(11 * i) % 250 + 5 for i in range(170)]
NO_EOS_BIAS = {int(k): v for k, v in NO_EOS.items()}
STEP = 64


def _engine(model: Path, **config) -> Engine:
    engine = Engine(EngineConfig(model=str(model), prefill_step_size=STEP, **config))
    engine.start()
    assert engine.wait_ready(120), engine.load_error
    return engine


async def _one(engine: Engine, prompt: list[int], tokens: int = 8) -> list[int]:
    handle = engine.submit(
        GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0, logit_bias=NO_EOS_BIAS),
        )
    )
    out = []
    async for event in handle:
        if isinstance(event, TokenEvent):
            out.append(event.token)
        elif isinstance(event, ErrorEvent):
            raise AssertionError(event.message)
    return out


def _alone(engine: Engine, prompts: list[list[int]], tokens: int = 8) -> list[list[int]]:
    async def run() -> list[list[int]]:
        return [await _one(engine, p, tokens) for p in prompts]

    return asyncio.run(run())


def _together(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(_one(engine, p) for p in prompts)))

    return asyncio.run(run())


def _prepared(cache_arch_dirs: dict[str, Path], tmp_path: Path, arch: str) -> Path:
    bits = None if arch == "llama" else 4
    return prepare(str(cache_arch_dirs[arch]), tmp_path / f"{arch}-prepared", expert_bits=bits)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next"])
def test_layer_major_is_token_identical_to_chunked_and_resident(
    cache_arch_dirs: dict[str, Path], tmp_path: Path, arch: str
):
    prepared = _prepared(cache_arch_dirs, tmp_path, arch)
    offloaded = {"resident_layers": 0}
    if arch != "llama":
        offloaded["expert_cache"] = "3"  # top-2 of 8: far fewer slots than a prompt needs
    results = {}
    for name, knobs in (
        ("resident", {}),
        ("chunked", {**offloaded, "prefill_order": "chunked"}),
        ("layer-major", offloaded),
    ):
        engine = _engine(prepared, **knobs)
        try:
            loads = engine.loaded.streamer.stats.layer_loads if engine.loaded.streamer else 0
            results[name] = (_alone(engine, [LONG, OTHER]), _together(engine, [LONG, OTHER]))
            if engine.loaded.streamer:
                loads = engine.loaded.streamer.stats.layer_loads - loads
            results[name] += (loads,)
        finally:
            engine.shutdown()
    expected = results["resident"][0]
    assert len(expected[0]) == 8
    for name in ("chunked", "layer-major"):
        alone, together, _ = results[name]
        assert alone == expected, name
        assert together == expected, name  # two prompts prefilled in one layer-major pass
    # The same requests read fewer layers: one pass per prefill, not one per chunk.
    assert results["layer-major"][2] < results["chunked"][2]


def test_a_streamed_layer_is_read_once_per_prefill(
    cache_arch_dirs: dict[str, Path], tmp_path: Path
):
    prepared = _prepared(cache_arch_dirs, tmp_path, "llama")
    for order, passes in (("auto", 1), ("chunked", 6)):
        engine = _engine(prepared, resident_layers=0, prefill_order=order)
        try:
            streamer = engine.loaded.streamer
            layers = len(streamer.streamed_layers)
            layer_bytes = sum(streamer.layer_bytes(i) for i in streamer.streamed_layers)
            _alone(engine, [OTHER], tokens=1)  # steady state: layer 0 is prefetched
            loads, read = streamer.stats.layer_loads, streamer.stats.bytes_read
            first = _alone(engine, [LONG], tokens=1)
            loads = streamer.stats.layer_loads - loads
            read = streamer.stats.bytes_read - read
        finally:
            engine.shutdown()
        assert len(first[0]) == 1
        if order == "auto":
            # One read per layer gives the prompt's cache and its first token.
            assert (loads, read) == (layers, layer_bytes)
        else:  # 5 chunks, the last token, and the pipelined first decode step
            assert loads >= passes * layers, loads


def test_each_chunk_gets_its_expert_rows_in_a_block_of_its_own(
    cache_arch_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A layer-major round's merged expert call hands each chunk its rows in a block of its
    own, as the call made them: not a copy of the call's whole output (an integer index
    on MLX's first axis is a gather), and not a view sharing one block with the other
    chunks (then mlx-lm's weighting by the router's scores cannot write in place and
    makes a second block of the call's size)."""
    import numpy as np

    from flashserve.engine.experts.offload import ExpertOffload
    from flashserve.engine.generation.prefill import layer_major as prefill

    made: list[list[mx.array]] = []
    given: list[list[mx.array]] = []
    real_run, real_resume = ExpertOffload.run_prefill, prefill.LayerMajorPrefill._resume

    def run_prefill(self, *args, **kwargs):
        out = real_run(self, *args, **kwargs)
        made.append(out)
        given.append([])
        return out

    def resume(self, chunk, *value):
        if given:
            given[-1].extend(v for v in value if isinstance(v, mx.array))
        return real_resume(self, chunk, *value)

    monkeypatch.setattr(ExpertOffload, "run_prefill", run_prefill)
    monkeypatch.setattr(prefill.LayerMajorPrefill, "_resume", resume)
    # On the CPU: a GPU's allocator packs small blocks end to end (the GPU check ran this).
    before = mx.default_device()
    engine = _engine(
        _prepared(cache_arch_dirs, tmp_path, "qwen3_moe"), expert_cache="3", device="cpu"
    )
    try:
        assert len(_alone(engine, [LONG], tokens=1)[0]) == 1
    finally:
        engine.shutdown()
        mx.set_default_device(before)
    assert made

    def span(a: mx.array) -> tuple[int, int]:
        start = np.array(a, copy=False).ctypes.data
        return start, start + a.nbytes

    for parts, handed in zip(made, given, strict=True):
        assert isinstance(parts, list) and len(parts) >= 2  # LONG: several chunks a round
        assert [span(p) for p in parts] == [span(h) for h in handed]  # as made: no copy
        ends = sorted(span(p) for p in parts)
        # Views of one block would touch end to end; blocks of their own do not.
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ends))


def _cache_stats(server) -> dict:
    return httpx.get(f"{server.url}/cache/stats", timeout=10).json()


def test_an_expert_is_read_at_most_once_per_prefill_per_layer(
    cache_arch_dirs: dict[str, Path], tmp_path: Path
):
    prepared = _prepared(cache_arch_dirs, tmp_path, "qwen3_moe")
    misses = {}
    for order in ("auto", "chunked"):
        (tmp_path / order).mkdir()
        server = start_server(
            prepared,
            tmp_path / order,
            "--expert-cache",
            "3",
            "--prefill-step-size",
            "16",
            "--prefill-order",
            order,
        )
        try:
            body = {"model": server.model_id, "prompt": LONG[:200], "max_tokens": 1}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            stats = _cache_stats(server)
        finally:
            stop_server(server)
        layers = stats["since_start"]["layers"]
        assert layers, stats
        misses[order] = [layer["misses"] + layer["prefetch_hits"] for layer in layers]
        experts = stats["total_experts"] // len(layers)
    # 200 tokens route to most of the 8 experts of each layer: each is read once,
    # not once per chunk of 16 as chunked prefill through a 3-slot cache does.
    assert all(0 < m <= experts for m in misses["auto"]), misses
    assert sum(misses["chunked"]) > 2 * sum(misses["auto"]), misses


def test_a_long_prefill_keeps_decodes_working_set(cache_arch_dirs: dict[str, Path], tmp_path: Path):
    prepared = _prepared(cache_arch_dirs, tmp_path, "qwen3_moe")
    engine = _engine(prepared, expert_cache="6")
    try:
        cache = engine.loaded.experts.cache
        short = LONG[:6]
        _alone(engine, [short], tokens=12)
        assert len(cache) == 6  # full: a prefill could only make room by evicting
        kept = set(cache.keys())
        misses = engine.loaded.experts.snapshot().since_start.misses
        _alone(engine, [LONG], tokens=1)
        assert engine.loaded.experts.snapshot().since_start.misses > misses  # it read
        assert set(cache.keys()) == kept
    finally:
        engine.shutdown()


def test_a_prefill_borrows_the_plans_room_and_decode_fills_it_back(
    cache_arch_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The memory plan's prefill room (streaming/memplan.py): a prefill evicts experts
    until the room is free and keeps it free while it runs; decode then fills the
    cache to its whole capacity again, and the output stays the resident model's.
    While it runs glibc's arenas serve its large blocks (compute/heap.py)."""
    from flashserve.engine.compute import heap
    from flashserve.engine.experts import offload

    monkeypatch.setattr(heap, "_fixed", heap.MMAP_THRESHOLD)  # as the plan sets it

    prepared = _prepared(cache_arch_dirs, tmp_path, "qwen3_moe")
    resident = _engine(prepared)
    try:
        expected = _alone(resident, [LONG[:6], LONG], tokens=12)
    finally:
        resident.shutdown()
    engine = _engine(prepared, expert_cache="8", prompt_cache_bytes=1 << 30)
    try:
        experts = engine.loaded.experts
        record = max(experts.nbytes.values())
        cache = experts.cache
        cache.capacity = type(cache.capacity)(nbytes=8 * record)  # bytes: the room is bytes
        cache.prefill_room = cache.chunk_activation_bytes = 3 * record
        cache.state_bytes_per_token = record // 1000
        hidden, top_k = (
            engine.loaded.config["hidden_size"],
            engine.loaded.config["num_experts_per_tok"],
        )
        # hidden states and MoE rows, in the device's activation dtype
        held_per_token = (2 + 2 * top_k + 1) * hidden * compute_dtype().size
        seen: list[tuple[int, int]] = []
        real = offload.expert_major

        raised: list[bool] = []

        def watched(*args, **kwargs):
            seen.append((cache.nbytes, cache.held))
            raised.append(heap._raised)
            out = real(*args, **kwargs)
            seen.append((cache.nbytes, cache.held))
            return out

        monkeypatch.setattr(offload, "expert_major", watched)
        got = [_alone(engine, [LONG[:6]], tokens=12)[0]]
        assert cache.nbytes == 8 * record  # decode filled it
        seen.clear()
        got += _alone(engine, [LONG], tokens=12)
        assert seen, "the prefill made no expert-major call"
        # LONG is longer than a chunk: the whole room is held through the prefill,
        # and the copies of LONG[:6]'s stored state it starts from.
        room = 3 * record + 2 * 6 * (record // 1000)
        assert all(held == room and n + held <= 8 * record for n, held in seen), seen
        assert cache.held == 0  # given back when the prefill ended
        assert raised and all(raised) and not heap._raised  # and the plan's threshold
        assert cache.nbytes == 8 * record  # and decode filled the cache again
        assert got == expected
        # The next turn starts from LONG's stored state: its few new tokens need
        # little room for activations, but the hit's copies of that state need room.
        seen.clear()
        _alone(engine, [[*LONG, 7, 8, 9]], tokens=2)
        assert seen
        # the 3 new tokens: a share of a chunk's activations and their held states
        room = int(min(3 * record, 3 * record * 3 / STEP + 3 * held_per_token))
        copies = 2 * len(LONG) * (record // 1000)  # LONG's whole state
        assert all(held == room + copies for _, held in seen), (seen, record)
        assert all(n + held <= 8 * record for n, held in seen), seen
    finally:
        engine.shutdown()
