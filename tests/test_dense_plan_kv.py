"""What the dense memory plan gives up for resident layers (streaming/denseplan.py):
the KV cache's precision (`plan_kv_bits`), and the streaming buffers lent with the
last streamed layers (streaming/lending.py). Issue 54: a model that fits in 1.4x
its size kept 16 of 24 layers beside a float cache, and decoded at a fifth of
llama-server's speed.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import mlx.core as mx

from flashserve.engine.config import EngineConfig
from flashserve.engine.generation import decode_step, memory_guard
from flashserve.engine.generation.memory_guard import MemoryGuard
from flashserve.engine.loader import load
from flashserve.engine.streaming.denseplan import DenseShape, plan_dense
from flashserve.engine.streaming.lending import Lending
from tests.streaming_fixtures import big_llama
from tests.test_decode_step import decode
from tests.test_dense_memory_plan import CAP, MB, _planned, _settings, _shape, streamed_llama
from tests.test_memory_limits import served_in_group
from tests.test_streaming import PROMPT, greedy

FLOAT_KV = 200 * 1024  # bytes per token, as _shape's
EIGHT_BIT_KV = FLOAT_KV * 9 // 32  # 8 bits and a scale and bias per 64 values


def _quantizable(**changes: object) -> DenseShape:
    """_shape, with its KV priced at 8 bits when the plan asks."""

    def requantize(bits: int | None) -> DenseShape:
        per = FLOAT_KV if bits is None else EIGHT_BIT_KV
        return dataclasses.replace(shape, kv_bytes_per_token=per, kv_bits=bits)

    shape = _shape(requantize=requantize, **changes)
    return shape


def _plan(available: int, shape: DenseShape | None = None, **settings: object):
    return plan_dense(
        shape or _quantizable(),
        _settings(**{"plan_kv_bits": 8, **settings}),
        limit=available + 100 * MB,
        available=available,
        source="cgroup v1 /x",
        shed_floor=300 * MB,
        file_bytes=40 * MB,
        disk_tier=True,
    )


def test_layers_that_do_not_all_fit_take_an_8_bit_cache_after_the_memory_tier() -> None:
    float_plan, float_kept = _plan(1100 * MB, plan_kv_bits=None)
    plan, kept = _plan(1100 * MB)
    assert float_plan.kv_bits is None and float_kept.kv_bits is None
    assert plan.kv_bits == kept.kv_bits == 8
    assert plan.resident_layers > float_plan.resident_layers
    assert plan.kv_reserve_bytes < float_plan.kv_reserve_bytes // 3
    given = [r for r in plan.reasons if "layers do not all fit" in r]
    assert "disk tier only" in given[0] and "the KV cache at 8 bits" in given[1], given
    assert _planned(plan) <= plan.limit_bytes


def test_a_model_that_fits_keeps_its_float_cache() -> None:
    plan, kept = _plan(4096 * MB)
    assert plan.resident_layers == 24 and plan.kv_bits is None and kept.kv_bits is None
    assert not any("KV cache" in r for r in plan.reasons)


def test_a_set_precision_is_never_changed() -> None:
    """kv_bits set (4 here) is the user's: the plan prices it and keeps it."""
    shape = _quantizable()
    four = dataclasses.replace(shape, kv_bytes_per_token=FLOAT_KV // 7, kv_bits=4)
    plan, kept = _plan(900 * MB, shape=four, kv_bits=4)
    assert plan.resident_layers < 24  # layers that do not all fit: the step's case
    assert plan.kv_bits == kept.kv_bits == 4
    assert not any("KV cache at" in r for r in plan.reasons)


def test_a_cache_that_would_not_shrink_stays_float() -> None:
    """A model whose layers are all sliding windows: quantizing saves nothing."""
    shape = _quantizable()
    same = dataclasses.replace(shape, requantize=lambda bits: dataclasses.replace(shape))
    plan, _ = _plan(1100 * MB, shape=same)
    assert plan.kv_bits is None


def test_a_tight_limit_gives_up_the_precision_second() -> None:
    order = []
    for available in range(800, 100, -10):
        try:
            plan, _ = _plan(available * MB)
        except Exception:
            break
        given = [r.split("gave up ")[1].split(":")[0] for r in plan.reasons if "gave up" in r]
        assert _planned(plan) <= plan.limit_bytes
        order = max(order, given, key=len)
    assert order[:3] == [
        "the prompt cache's memory tier",
        "the KV cache's precision",
        "prefetch depth",
    ]


def test_the_buffers_go_with_the_last_streamed_layers(tmp_path_factory) -> None:
    """With the loan and the streaming buffers together enough for every streamed
    layer, all of them stay resident after one token, nothing is read any more and
    no spare buffer is kept; the greedy tokens are the resident model's. When the
    room shrinks the layers go back, buffers not counted."""
    loaded, ref_tokens, ref_logprobs = streamed_llama(tmp_path_factory)
    streamer = loaded.streamer
    layers = len(streamer.layers)
    size = max(streamer.layer_bytes(i) for i in range(layers))
    lending = Lending(
        streamer,
        10 * layers * size,
        0,
        kv_bytes_per_token=0,
        planned_depth=1,
        max_depth=1,
        buffer_bytes=2 * size,  # (depth + 1) layers
    )
    lending.settle((layers - 3) * size, grow=True)  # three layers stream, recycling buffers
    greedy(loaded.model, PROMPT, tokens=2)
    assert len(streamer.lent) == layers - 3 and streamer._free
    lending.settle((layers - 2) * size, grow=True)  # the buffers make up the rest
    tokens, logprobs, _ = greedy(loaded.model, PROMPT)
    assert tokens == ref_tokens and mx.allclose(logprobs, ref_logprobs, atol=1e-4).item()
    assert streamer.streamed_layers == [] and len(streamer.lent) == layers
    assert streamer._free == {} and streamer._pending == {}
    loads = streamer.stats.layer_loads
    greedy(loaded.model, PROMPT, tokens=4)
    assert streamer.stats.layer_loads == loads
    lending.settle((layers - 2) * size, grow=True)  # the same room: they stay
    assert len(streamer.lent) == layers
    lending.settle((layers - 3) * size, grow=True)  # less: buffers no longer count
    assert len(streamer.lent) == layers - 3
    tokens, _, _ = greedy(loaded.model, PROMPT)
    assert tokens == ref_tokens


def test_a_server_in_a_cgroup_takes_an_8_bit_cache_and_answers_as_kv_bits_8(
    tmp_path_factory, tmp_path
) -> None:
    """The README's command for a dense model larger than memory, nothing else set:
    the plan takes the 8-bit cache (GET /memory says so, and why), its reserves sum
    under the real limit, and the greedy answer is the fully resident model's with
    kv_bits 8; the kernel kills nothing."""
    _, prepared = big_llama(tmp_path_factory)
    cache = str(tmp_path / "prompt-cache")
    args = ("--residency", "auto", "--prompt-cache-dir", cache)
    with served_in_group(CAP, prepared, tmp_path, *args) as (server, group):
        http = server.http(timeout=600)
        plan = http.get("/memory").json()["memory_plan"]
        assert plan["kv_bits"] == 8, plan["reasons"]
        assert any("the KV cache at 8 bits" in r for r in plan["reasons"]), plan["reasons"]
        assert _planned(SimpleNamespace(**plan)) <= CAP
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1}
        reply = http.post("/v1/completions", json=body)  # no bias: the logprobs as computed
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert len(choice["logprobs"]["token_logprobs"]) == 16  # greedy: no EOS here
        served = choice["logprobs"]["token_logprobs"][-1]
        gaps = {}
        for bits in (8, None):
            resident = load(EngineConfig(model=str(prepared), kv_bits=bits))
            ref_tokens, ref_logprobs, _ = greedy(resident.model, PROMPT, tokens=16)
            if bits == 8:
                assert choice["text"] == resident.tokenizer.decode(ref_tokens)
            gaps[bits] = abs(served - ref_logprobs[ref_tokens[-1]].item())
        # The 8-bit cache's numbers (the server's prefill and compiled steps take
        # other arithmetic paths: 2e-4 measured), not the float cache's (1e-2 away;
        # its tokens may well agree).
        assert gaps[8] < 1e-3 < gaps[None], gaps
        assert server.process is not None and server.process.poll() is None
        assert "oom_kill 0" in (group / "memory.oom_control").read_text()


def test_with_every_layer_on_loan_decode_steps_compile_until_one_streams(tmp_path_factory):
    """Under a streamer, decode steps compile while no layer streams (the loan holds
    them all), to the bit what uncompiled steps give; a layer given back drops the
    traces (they hold the weights) and steps run uncompiled again, the same."""
    loaded, _, _ = streamed_llama(tmp_path_factory)
    streamer = loaded.streamer
    size = max(streamer.layer_bytes(i) for i in range(len(streamer.layers)))
    lending = Lending(streamer, 100 * size, 0, kv_bytes_per_token=0, planned_depth=1, max_depth=1)
    compiled = decode_step.CompiledDecode(loaded.model, streamer)
    prompts, lengths = [[5, 9, 13], [7, 3, 11, 2, 8, 4], [9, 2, 5]], [40, 12, 20]
    streaming = decode(compiled, prompts, lengths, join_at=4)
    assert compiled.steps == 0  # layers stream: never compiled
    lending.settle(50 * size, grow=True)
    greedy(loaded.model, PROMPT, tokens=2)  # each layer stays once it has run
    assert streamer.streamed_layers == []
    plain = decode(loaded.model, prompts, lengths, join_at=4)
    on_loan = decode(compiled, prompts, lengths, join_at=4)
    assert compiled.steps >= lengths[0] - 2 and compiled._fns
    for uid, (tokens, logprobs) in plain.items():
        assert on_loan[uid][0] == tokens == streaming[uid][0], uid
        for got, want in zip(on_loan[uid][1], logprobs, strict=True):
            assert mx.array_equal(got, want).item(), uid
    lending.settle(size, grow=False)  # a prefill comes: all but one layer go back
    assert len(streamer.streamed_layers) == len(streamer.layers) - 1
    assert compiled._fns == {}  # the traces and the weights they held are gone
    steps = compiled.steps
    again = decode(compiled, prompts, lengths, join_at=4)
    assert compiled.steps == steps
    assert {uid: t for uid, (t, _) in again.items()} == {u: t for u, (t, _) in plain.items()}


def test_the_layers_a_prefill_streamed_go_on_loan_with_the_first_decode_step(
    tmp_path_factory, tmp_path
) -> None:
    """At 1.6x the model, the plan streams some layers to leave a prefill its room; the
    loan holds them all once decoding. The prefill's room is the loan's again as soon
    as the prompt is prefilled (memory_guard.py after_prefill): the first decode step
    reads each such layer once and keeps it, where it used to read them and drop them,
    and the second read them again (issue 54: 7 MB a token at the 1.4x cap, now 3)."""
    _, prepared = big_llama(tmp_path_factory)
    total = json.loads((prepared / "manifest.json").read_text())["total_bytes"]
    cache = str(tmp_path / "prompt-cache")
    args = ("--residency", "auto", "--prompt-cache-dir", cache, "--stream-keepalive", "0")
    with served_in_group(int(total * 1.6), prepared, tmp_path, *args) as (server, group):
        http = server.http(timeout=600)
        streamed = http.get("/memory").json()["streamed_layers"]
        assert streamed  # the prefill's room: some layers stream
        body = {"prompt": [20 + i % 280 for i in range(300)], "max_tokens": 12, "temperature": 0}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        memory = http.get("/memory").json()
        assert sorted(memory["lent_layers"]) == streamed and memory["streamed_layers"] == []
        # One read for the layer-major prefill, one for the first step, none after.
        assert memory["streaming"]["layer_loads"] <= 2 * len(streamed) + 1
        assert "oom_kill 0" in (group / "memory.oom_control").read_text()


def test_an_answers_state_copy_takes_lent_layers_back_first(tmp_path_factory, monkeypatch):
    """An ended answer's state is copied for the prompt cache beside the batch's rows
    (memory_guard.py before_store). Where what is really free, less what the plan keeps
    free, cannot hold the copies, lent layers go back first, as few as cover them;
    greedy tokens stay the resident model's."""
    loaded, ref_tokens, _ = streamed_llama(tmp_path_factory)
    streamer = loaded.streamer
    size = streamer.layer_bytes(0)
    keep = 64 * MB
    guard = MemoryGuard(loaded, None)
    guard.lending = Lending(
        streamer, 10 * size, 0, kv_bytes_per_token=0, planned_depth=1, max_depth=1, keep_free=keep
    )
    guard.lending.settle(3 * size + size // 2, grow=True)
    greedy(loaded.model, PROMPT, tokens=2)
    assert len(streamer.lent) == 3
    monkeypatch.setattr(memory_guard, "available_memory", lambda: keep + size // 2)
    guard.before_store(size // 4)  # really free: nothing goes back
    assert len(streamer.lent) == 3
    guard.before_store(size)  # half a layer short: one goes back
    assert len(streamer.lent) == 2
    guard.before_store(2 * size)  # a layer and a half short: both
    assert streamer.lent == []
    tokens, _, _ = greedy(loaded.model, PROMPT)
    assert tokens == ref_tokens
