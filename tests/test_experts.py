"""MoE expert offload on tiny real models of three mlx-lm MoE architectures.

Each model is written on the fly (engine.synthetic), prepared with 4-bit
experts (engine.prepare), and loaded through the real loader with an expert
cache. Greedy output must be token-identical to the same prepared model with
every expert resident, at any cache size.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from flashserve.engine.config import EngineConfig
from flashserve.engine.experts.cache import LRU, Belady, Capacity, ExpertCache, LFUDecay
from flashserve.engine.experts.install import OffloadedSwitchGLU
from flashserve.engine.experts.replay import load_trace, replay
from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.loader import load
from flashserve.engine.weights.layout import read_manifest
from flashserve.engine.weights.model import ModelLoadError
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_next"]
PROMPT = "Hello, how are you? Tell me about the capital of France."
TOKENS = 32
TOP_K = 2  # num_experts_per_tok of engine.synthetic's MoE models
EXPERTS = 8
LAYERS = 4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("experts")
    out = {}
    for arch in ARCHS:
        src = make_model_dir(root / arch / "src", arch)
        out[arch] = prepare(str(src), root / arch / "prepared", expert_bits=4)
    return out


def greedy(loaded, prompt: str = PROMPT, tokens: int = TOKENS) -> tuple[list[int], mx.array]:
    ids = mx.array(loaded.tokenizer.encode(prompt))
    out, last = [], None
    for token, logprobs in generate_step(
        ids, loaded.model, max_tokens=tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    ):
        out.append(int(token))
        last = logprobs
    return out, last


@pytest.fixture(scope="module")
def reference(prepared: dict[str, Path]) -> dict[str, tuple[list[int], mx.array]]:
    return {arch: greedy(load(EngineConfig(model=str(path)))) for arch, path in prepared.items()}


# -- token identity -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "cache",
    [
        str(TOP_K),  # one layer's top-k in all: prompts run in chunks
        str(TOP_K * LAYERS),  # top-k per layer: thrashing
        str(EXPERTS * LAYERS // 2),  # 50%
        str(EXPERTS * LAYERS),  # 100%
    ],
)
def test_greedy_output_identical_to_resident(prepared, reference, arch, cache) -> None:
    loaded = load(EngineConfig(model=str(prepared[arch]), expert_cache=cache))
    assert loaded.experts is not None
    tokens, logprobs = greedy(loaded)
    ref_tokens, ref_logprobs = reference[arch]
    assert tokens == ref_tokens
    assert mx.allclose(logprobs, ref_logprobs, atol=1e-4).item()
    stats = loaded.experts.snapshot()
    view = stats.since_start
    assert view.hits + view.misses == sum(layer.hits + layer.misses for layer in view.layers)
    assert view.misses > 0  # experts really came from disk
    assert stats.occupancy_slots <= int(cache)
    if cache == str(TOP_K * LAYERS):
        assert view.evictions > 0
    loaded.experts.close()


def test_every_moe_block_is_offloaded(prepared) -> None:
    loaded = load(EngineConfig(model=str(prepared["qwen2_moe"]), expert_cache="8"))
    blocks = [layer.mlp for layer in loaded.model.layers]
    assert all(isinstance(b.switch_mlp, OffloadedSwitchGLU) for b in blocks)
    # Shared experts and routers stay ordinary resident modules.
    assert all(b.shared_expert.gate_proj.weight.size > 0 for b in blocks)
    assert all(b.gate.weight.size > 0 for b in blocks)
    loaded.experts.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_streamed_layers_with_expert_cache_and_prefetch(prepared, reference, arch) -> None:
    config = EngineConfig(
        model=str(prepared[arch]),
        expert_cache=str(TOP_K * LAYERS),
        expert_prefetch="next-layer",
        expert_policy="lfu",
        residency="fixed",
        resident_layers=1,
    )
    loaded = load(config)
    tokens, _ = greedy(loaded)
    assert tokens == reference[arch][0]
    view = loaded.experts.snapshot().since_start
    assert 0.0 <= view.prefetch_precision <= 1.0
    assert 0.0 <= view.prefetch_recall <= 1.0
    assert view.prefetch_reads > 0
    assert (
        view.prefetch_wasted_bytes == view.prefetch_wasted * loaded.experts.snapshot().expert_bytes
    )
    assert view.prefetch_hits <= view.prefetch_reads
    loaded.experts.close()


# -- refusals and errors ------------------------------------------------------------


def test_cache_smaller_than_top_k_is_refused(prepared) -> None:
    with pytest.raises(ModelLoadError, match=r"smaller than one layer's top-k.*--expert-cache 2"):
        load(EngineConfig(model=str(prepared["mixtral"]), expert_cache="1"))
    with pytest.raises(ModelLoadError, match="smaller than one layer's top-k"):
        load(EngineConfig(model=str(prepared["mixtral"]), expert_cache="1KB"))
    with pytest.raises(ModelLoadError, match="expected a slot count"):
        load(EngineConfig(model=str(prepared["mixtral"]), expert_cache="lots"))


def test_expert_cache_needs_a_prepared_model(tmp_path) -> None:
    src = make_model_dir(tmp_path / "m", "qwen3_moe")
    with pytest.raises(ModelLoadError, match="prepared model"):
        load(EngineConfig(model=str(src), expert_cache="4"))


def _expert_file(path: Path, layer: int) -> tuple[Path, list[list[int]]]:
    manifest = read_manifest(path)
    experts = manifest["layers"][layer]["experts"]
    return path / experts["file"], experts["switches"][0]["records"]


def _run(engine: Engine, text: str = PROMPT, tokens: int = 8) -> list:
    async def go() -> list:
        prompt = engine.loaded.tokenizer.encode(text)
        request = GenerationRequest(prompt, tokens, SamplingParams(temperature=0))
        return [event async for event in engine.submit(request)]

    return asyncio.run(go())


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_expert_file_fails_the_request_naming_layer_and_expert(
    prepared, tmp_path, damage
) -> None:
    # A private copy: the damage must not leak into other tests.
    import shutil

    path = tmp_path / "prepared"
    shutil.copytree(prepared["qwen3_moe"], path)
    engine = Engine(EngineConfig(model=str(path), expert_cache=str(TOP_K)))
    engine.start()
    try:
        assert engine.wait_ready(60), engine.load_error
        good = _run(engine)
        assert isinstance(good[-1], DoneEvent)
        file, records = _expert_file(path, 1)
        original = file.read_bytes()
        if damage == "corrupt":
            data = bytearray(original)
            for offset, length in records:  # every expert of layer 1, so routing cannot dodge it
                data[offset + length // 2] ^= 0xFF
            file.write_bytes(bytes(data))
        else:
            os.truncate(file, records[0][0] + 10)
        events = _run(engine)
        assert isinstance(events[-1], ErrorEvent)
        message = events[-1].message
        assert re.search(r"expert \d+ of layer 1", message), message
        assert ("checksum" if damage == "corrupt" else "truncated") in message
        # The worker keeps serving: with the file restored the same request works again.
        file.write_bytes(original)
        again = _run(engine)
        assert isinstance(again[-1], DoneEvent)
        assert [e.token for e in again if isinstance(e, TokenEvent)] == [
            e.token for e in good if isinstance(e, TokenEvent)
        ]
    finally:
        engine.shutdown()


# -- counters on a hand-computed routing sequence -----------------------------------


def _drive(loaded, calls: list[tuple[int, list[int]]]) -> None:
    """Call the offloaded SwitchGLU of `layer` with a one-token routing `experts`."""
    offload = loaded.experts
    hidden = loaded.config["hidden_size"]
    x = mx.random.normal((1, 1, hidden))
    for layer, experts in calls:
        y = offload.run(layer, x, mx.array([[experts]], dtype=mx.uint32))
        mx.eval(y)


# Layer 0 only, cache of 3 slots, each call one token routed to two experts.
# LRU:  [0,1] m m | [0,2] h m | [0,3] h m (evict 1) | [1,2] h m (evict 0) | [0,1] h m (evict 3)
# LFU:  [0,1] m m | [0,2] h m | [0,3] h m (evict 1: count 1, older than 2)
#       | [1,2] h(2) m(1) (evict 3: count 1 < 0's 3) | [0,1] h h
SEQUENCE = [(0, [0, 1]), (0, [0, 2]), (0, [0, 3]), (0, [1, 2]), (0, [0, 1])]


@pytest.mark.parametrize(
    "policy, hits, misses, evictions, resident",
    [("lru", 4, 6, 3, {0, 1, 2}), ("lfu", 5, 5, 2, {0, 1, 2})],
)
def test_counters_exact_on_hand_computed_routing(
    prepared, policy, hits, misses, evictions, resident
) -> None:
    path = prepared["mixtral"]
    loaded = load(EngineConfig(model=str(path), expert_cache="3", expert_policy=policy))
    _drive(loaded, SEQUENCE)
    stats = loaded.experts.snapshot()
    layer0 = stats.since_start.layers[0]
    assert (layer0.hits, layer0.misses, layer0.evictions) == (hits, misses, evictions)
    assert layer0.hit_rate == pytest.approx(hits / (hits + misses))
    assert {e for (_, e) in loaded.experts.cache} == resident
    assert stats.occupancy_slots == 3 and stats.occupancy_fraction == 1.0
    record = loaded.experts.nbytes[0]
    assert layer0.bytes_read == misses * record
    assert stats.since_start.forwards == len(SEQUENCE)  # layer 0 is the first MoE layer
    # The window sees the same, until it is reset.
    assert stats.window.misses == misses
    loaded.experts.reset_window()
    assert loaded.experts.snapshot().window.misses == 0
    assert loaded.experts.snapshot().since_start.misses == misses
    loaded.experts.close()


def test_global_pool_counts_evictions_across_layers(prepared) -> None:
    # 4 slots shared by layers 0 and 1 (LRU):
    # L0 [0,1] m m | L1 [0,1] m m | L0 [0,2] h m, evicts (0,1) | L1 [1,2] h m, evicts (1,0)
    loaded = load(EngineConfig(model=str(prepared["mixtral"]), expert_cache="4"))
    _drive(loaded, [(0, [0, 1]), (1, [0, 1]), (0, [0, 2]), (1, [1, 2])])
    layers = loaded.experts.snapshot().since_start.layers
    assert [(s.hits, s.misses, s.evictions) for s in layers[:2]] == [(1, 3, 1), (1, 3, 1)]
    assert set(loaded.experts.cache.keys()) == {(0, 0), (0, 2), (1, 1), (1, 2)}
    loaded.experts.close()


# -- traces and replay --------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_replay_of_a_recorded_trace_matches_live_counters(prepared, tmp_path, policy) -> None:
    trace = tmp_path / "routing.jsonl"
    cache = TOP_K * LAYERS + 3
    loaded = load(
        EngineConfig(
            model=str(prepared["qwen3_moe"]),
            expert_cache=str(cache),
            expert_policy=policy,
            record_routing=str(trace),
        )
    )
    greedy(loaded, tokens=12)
    greedy(loaded, "The quick brown fox", tokens=12)
    live = loaded.experts.snapshot().since_start
    loaded.experts.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {line["layer"] for line in lines} == set(range(LAYERS))
    assert all(len(line["experts"]) == TOP_K for line in lines)
    groups = load_trace(trace)
    result = replay(groups, cache, policy, accesses_per_token=TOP_K * LAYERS)
    assert (result.hits, result.misses) == (live.hits, live.misses)
    best = replay(groups, cache, "belady")
    assert best.hits >= result.hits


def _optimal_misses(seq: list[int], slots: int) -> int:
    """Fewest misses over every possible eviction choice (exhaustive search)."""
    best = {frozenset(): 0}
    for key in seq:
        nxt: dict[frozenset, int] = {}
        for state, misses in best.items():
            if key in state:
                options = [(state, misses)]
            elif len(state) < slots:
                options = [(state | {key}, misses + 1)]
            else:
                options = [((state - {v}) | {key}, misses + 1) for v in state]
            for s, m in options:
                if m < nxt.get(s, 1 << 30):
                    nxt[s] = m
        best = nxt
    return min(best.values())


def test_belady_is_optimal_and_bounds_lru_and_lfu() -> None:
    rng = random.Random(0)
    for _ in range(30):
        seq = [rng.randrange(6) for _ in range(24)]
        groups = [[(0, e)] for e in seq]
        for slots in (2, 3):
            b = replay(groups, slots, "belady")
            assert b.misses == _optimal_misses(seq, slots)
            assert b.hits >= replay(groups, slots, "lru").hits
            assert b.hits >= replay(groups, slots, "lfu").hits


def test_policies_unit() -> None:
    cache = ExpertCache(Capacity(slots=2), LRU())
    cache.insert((0, 1), "a", 1)
    cache.insert((0, 2), "b", 1)
    assert cache.lookup((0, 1)) == "a"
    assert cache.insert((0, 3), "c", 1) == [(0, 2)]  # 2 is least recently used
    cache.pinned = {(0, 1), (0, 3)}
    with pytest.raises(ValueError, match="full of experts the current layer needs"):
        cache.insert((0, 4), "d", 1)

    lfu = ExpertCache(Capacity(nbytes=20), LFUDecay(half_life=1000))
    for key in [(0, 1), (0, 1), (0, 1), (0, 2)]:
        if lfu.lookup(key) is None:
            lfu.insert(key, key, 10)
    assert lfu.insert((0, 3), None, 10) == [(0, 2)]  # (0,1) is used more often
    assert Capacity.parse("3GB").nbytes == 3_000_000_000
    assert Capacity.parse("512MiB").nbytes == 512 << 20
    assert Capacity.parse("2048").slots == 2048

    # Decay: an expert hot long ago loses to one used a little, recently.
    decay = LFUDecay(half_life=4)
    for key in [(0, 1)] * 4 + [(0, 9)] * 40 + [(0, 2)] * 2:
        decay.access(key)
        if key in ((0, 1), (0, 2)) and key not in decay._rank:
            decay.insert(key)
    assert decay.victim(set()) == (0, 1)
    belady = Belady([[(0, 1)], [(0, 2)], [(0, 1)]])
    assert isinstance(belady.name, str)


def test_chunked_prefill_covers_every_routed_expert(prepared) -> None:
    # One call routing 6 tokens to 8 distinct experts, with a 2-slot cache: the
    # output must equal the resident SwitchGLU's on every token slot.
    path = prepared["qwen3_moe"]
    resident = load(EngineConfig(model=str(path)))
    offloaded = load(EngineConfig(model=str(path), expert_cache="2"))
    hidden = resident.config["hidden_size"]
    x = mx.random.normal((1, 6, hidden))
    idx = mx.array(np.array([[[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 3]]], np.uint32))
    want = resident.model.layers[2].mlp.switch_mlp(x, idx)
    got = offloaded.model.layers[2].mlp.switch_mlp(x, idx)
    assert mx.array_equal(want, got).item()
    layer2 = offloaded.experts.snapshot().since_start.layers[2]
    assert layer2.misses == 8 and layer2.hits == 0
    offloaded.experts.close()


def test_stacked_compute_is_identical_too(prepared, reference) -> None:
    config = EngineConfig(
        model=str(prepared["mixtral"]),
        expert_cache=str(TOP_K * LAYERS),
        extra={"expert_compute": "stacked"},
    )
    loaded = load(config)
    assert loaded.experts.stacked
    assert greedy(loaded)[0] == reference["mixtral"][0]
    loaded.experts.close()


def test_fast_kernel_runs_each_layer_once_over_the_cached_experts(tmp_path, monkeypatch) -> None:
    """On flashserve's kernel a decode call is one template call over a list of experts,
    built ahead of the router's sync when every expert it needs may be cached.

    The experts must all be quantized (engine.synthetic's default expert width
    of 32 leaves down_proj in float): a width of 64 quantizes all three.
    """
    from flashserve.engine.compute import qmm
    from flashserve.engine.experts import compute as expert_compute

    src = make_model_dir(tmp_path / "src", "qwen3_moe", overrides={"moe_intermediate_size": 64})
    path = prepare(str(src), tmp_path / "prepared", expert_bits=4)
    want = greedy(load(EngineConfig(model=str(path))))
    calls = []
    template = expert_compute.call_template

    def counting(info, x, remapped, experts, weights, stack=True):
        if not stack:
            calls.append(len(experts))
        return template(info, x, remapped, experts, weights, stack)

    monkeypatch.setattr(expert_compute, "call_template", counting)
    loaded = load(EngineConfig(model=str(path), expert_cache=str(EXPERTS * LAYERS // 2)))
    assert qmm.active()
    tokens, logprobs = greedy(loaded)
    assert tokens == want[0]
    assert mx.array_equal(logprobs, want[1]).item()  # the resident model's bits
    # Every decode call of every MoE layer (the prompt goes expert-major): calls
    # whose experts were all cached ran as built ahead, the others as a template call.
    ahead = loaded.experts.ahead_calls
    assert ahead > 0 and len(calls) > 0
    assert len(calls) + ahead >= LAYERS * (TOKENS - 1) and set(calls) <= {1, TOP_K}
    loaded.experts.close()


def test_memory_pressure_shrinks_the_cache_but_not_below_top_k(prepared, reference) -> None:
    total = EXPERTS * LAYERS
    loaded = load(EngineConfig(model=str(prepared["qwen3_moe"]), expert_cache=str(total - 4)))
    offload = loaded.experts
    assert offload.preload() == total - 4
    record = offload.nbytes[0]
    assert offload.shrink(10 * record) == 10 * record
    assert offload.cache.capacity.slots == total - 14 == len(offload.cache)
    assert offload.snapshot().occupancy_slots == total - 14
    offload.shrink(10**12)  # asks for everything: keeps one layer's top-k
    assert offload.cache.capacity.slots == TOP_K == len(offload.cache)
    assert greedy(loaded)[0] == reference["qwen3_moe"][0]
    offload.close()


def test_every_expert_cached_runs_on_slabs_without_syncs(prepared, reference) -> None:
    total = EXPERTS * LAYERS
    loaded = load(EngineConfig(model=str(prepared["qwen2_moe"]), expert_cache=str(total)))
    offload = loaded.experts
    assert offload.preload() == total
    assert all(info.slab is not None for info in offload.layers.values())
    tokens, logprobs = greedy(loaded)
    assert tokens == reference["qwen2_moe"][0]
    assert mx.allclose(logprobs, reference["qwen2_moe"][1], atol=1e-4).item()
    # Slab layers count their routing two forwards late; flush() counts the rest.
    offload.flush()
    view = offload.snapshot().since_start
    assert view.misses == 0 and view.evictions == 0
    # Every layer call of every forward counted: one-token calls use exactly top-k experts.
    prompt_calls = [s.hits for s in view.layers]
    assert len(set(prompt_calls)) >= 1 and all(h >= TOP_K * (TOKENS - 1) for h in prompt_calls)
    # Memory pressure drops slab layers whole, then the cache refills on demand.
    freed = offload.shrink(offload.nbytes[0])
    assert freed == total * offload.nbytes[0]
    assert all(info.slab is None for info in offload.layers.values())
    assert greedy(loaded)[0] == reference["qwen2_moe"][0]
    assert 0 < len(offload.cache) <= offload.cache.capacity.slots < total
    offload.close()


def test_batched_requests_through_the_engine_match_resident(prepared) -> None:
    """Concurrent requests share forwards (the worker batches them): still identical."""
    texts = [PROMPT, "The quick brown fox", "What is the weather today in Paris?"]

    def run_all(config: EngineConfig) -> list[list[int]]:
        engine = Engine(config)
        engine.start()
        try:
            assert engine.wait_ready(60), engine.load_error

            async def go() -> list[list[int]]:
                async def one(text: str) -> list[int]:
                    prompt = engine.loaded.tokenizer.encode(text)
                    request = GenerationRequest(prompt, 12, SamplingParams(temperature=0))
                    return [
                        e.token async for e in engine.submit(request) if isinstance(e, TokenEvent)
                    ]

                return list(await asyncio.gather(*(one(t) for t in texts)))

            return asyncio.run(go())
        finally:
            engine.shutdown()

    path = str(prepared["qwen3_next"])
    want = run_all(EngineConfig(model=path, max_batch=4))
    got = run_all(
        EngineConfig(
            model=path, max_batch=4, expert_cache=str(TOP_K * LAYERS), expert_prefetch="next-layer"
        )
    )
    assert got == want and all(len(tokens) > 0 for tokens in got)


@pytest.mark.parametrize(
    ("parts", "want"),
    [
        (None, {True: 80}),  # 80 slots: sorted, though no expert has 64 rows
        ([20, 20], {False: 80}),  # a merged call of two 40-slot runs: neither sorted
        ([40, 8], {True: 80, False: 16}),  # each run as the resident model would run it
    ],
)
@pytest.mark.parametrize("slab", [False, True], ids=["per-expert", "slab"])
def test_each_experts_slots_are_sorted_as_the_resident_call_sorts_them(
    prepared, monkeypatch, parts, want, slab
) -> None:
    """mlx-lm's SwitchGLU sorts a call's slots by expert from 64 slots on, and off the
    CPU the sort picks the kernel (MLX's CUDA backend: a grouped GEMM for sorted slots,
    a matrix-vector product per slot otherwise), so a slot's numbers depend on it. An
    expert's slots of an offloaded prefill call go through the template sorted or not
    as the resident call (each run of a merged call: its own) would sort them, although
    the expert has fewer than 64 of them. The GPU check showed tokens differing before.
    A layer whose experts are all cached runs as one stacked slab: each run of a merged
    call then goes to it as a call of its own."""
    from mlx_lm.models import switch_layers

    from flashserve.engine.experts import compute

    seen: dict[bool, int] = {}
    real = switch_layers.SwitchLinear.__call__

    def down_proj(self, x, indices, sorted_indices=False):  # float: 32 wide, not quantized
        seen[sorted_indices] = seen.get(sorted_indices, 0) + int(indices.size)
        return real(self, x, indices, sorted_indices=sorted_indices)

    cache = EXPERTS * LAYERS if slab else 2 * EXPERTS
    loaded = load(EngineConfig(model=str(prepared["qwen3_moe"]), expert_cache=str(cache)))
    offload = loaded.experts
    layer = offload.first_layer
    tokens = sum(parts) if parts else 40
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((tokens, 64)).astype(np.float32))
    # Every expert gets tokens * top-k / 8 slots: fewer than 64.
    ids = mx.array(np.array([[t % 8, (t + 3) % 8] for t in range(tokens)], dtype=np.uint32))
    compute.set_fused_experts(False)  # the CPU kernel's fused op has no sort to choose
    try:
        if slab:  # a first call reads and keeps every expert of the layer: a slab
            every = mx.array(np.arange(2 * tokens) % 8).reshape(-1, 2)
            mx.eval(offload.run_prefill(layer, x, every))
            assert offload.layers[layer].slab is not None
        monkeypatch.setattr(switch_layers.SwitchLinear, "__call__", down_proj)
        got = offload.run_prefill(layer, x, ids, parts=parts)
        mx.eval(got)
    finally:
        compute.set_fused_experts(True)
        offload.close()
    assert seen == want
    # and the numbers are the resident template's, run by the resident model's calls
    info = offload.layers[layer]
    resident = load(EngineConfig(model=str(prepared["qwen3_moe"])))
    template = resident.model.layers[layer].mlp.switch_mlp
    runs = parts or [tokens]
    bounds = np.cumsum([0, *runs])
    expected = [template(x[a:b], ids[a:b]) for a, b in itertools.pairwise(bounds)]
    outs = got if parts else [got]
    assert info.top_k == TOP_K
    assert all(
        mx.array_equal(o.reshape(e.shape), e).item() for o, e in zip(outs, expected, strict=True)
    )
