"""`--expert-cache auto`: the memory plan (streaming/memplan.py) on its own, and a
real server planning a MoE larger than its real cgroup v1 limit.
"""

from __future__ import annotations

import json

import pytest

from flashserve.engine.streaming.memplan import MIN_FLOOR, ModelShape, plan_memory
from tests.conftest import NO_EOS, stop_server
from tests.streaming_fixtures import big_moe
from tests.test_memory_limits import _make_group, _remove_group, _start_in_group

MB = 1024 * 1024


def _shape(**changes: object) -> ModelShape:
    shape = ModelShape(
        layer_bytes=[10 * MB] * 8,
        expert_bytes=2000 * MB,
        record_bytes=3 * MB,
        top_k=8,
        num_experts=64,
        kv_bytes_per_token=64 * 1024,
        activation_bytes=100 * MB,
    )
    for key, value in changes.items():
        setattr(shape, key, value)
    return shape


def _plan(shape: ModelShape, available: int, **kwargs: object):
    args = {
        "limit": 1200 * MB,
        "available": available,
        "source": "cgroup v1 /x",
        "shed_floor": 300_000_000,
        "kv_tokens": 1024,
        "prompt_cache_bytes": 1_000_000_000,
    }
    args.update(kwargs)
    return plan_memory(shape, **args)


def test_the_plan_fits_what_is_available_dense_layers_first() -> None:
    plan = _plan(_shape(), available=1000 * MB)
    # A small limit gets a small floor: 4% of it, not the configured 300 MB.
    assert plan.shed_floor_bytes == int(1200 * MB * 0.04)
    assert plan.kv_reserve_bytes == plan.prompt_cache_bytes == 1024 * 64 * 1024
    assert plan.resident_layers == 8 and plan.stream_buffer_bytes == 0
    planned = (
        plan.shed_floor_bytes
        + plan.headroom_bytes
        + plan.runtime_reserve_bytes
        + plan.kv_reserve_bytes
        + plan.prompt_cache_bytes
        + plan.resident_layer_bytes
        + plan.expert_cache_bytes
    )
    assert planned <= 1000 * MB
    assert plan.expert_cache_bytes >= 0.9 * (1000 * MB - (planned - plan.expert_cache_bytes))
    assert plan.in_use_bytes == 200 * MB
    assert any("dense layers resident first" in r for r in plan.reasons)
    # A prefill's activations are lent by the expert cache, not set aside for good.
    assert plan.prefill_reserve_bytes == 100 * MB
    assert plan.expert_cache_bytes - plan.prefill_reserve_bytes >= 2 * 8 * 3 * MB
    # Set aside for good (the plan before lending): 100 MB less to start from.
    for_good = _plan(_shape(activation_bytes=0), available=900 * MB)
    assert for_good.prefill_reserve_bytes == 0
    assert abs(plan.expert_cache_bytes - for_good.expert_cache_bytes - 98 * MB) <= MB


def test_experts_never_get_more_than_all_experts_nor_less_than_twice_top_k() -> None:
    roomy = _plan(_shape(expert_bytes=100 * MB), available=1000 * MB)
    assert roomy.expert_cache_bytes == 100 * MB
    assert roomy.prefill_reserve_bytes == 0  # every expert cached: nothing to lend
    assert any("every expert fits" in r for r in roomy.reasons)
    tight = _plan(_shape(), available=200 * MB, limit=250 * MB)
    assert tight.shed_floor_bytes == MIN_FLOOR
    assert tight.expert_cache_bytes == 2 * 8 * 3 * MB
    assert tight.resident_layers < 8  # dense layers gave way, down to the minimum
    assert any(r.startswith("WARNING") for r in tight.reasons)


def test_a_configured_layer_count_is_kept() -> None:
    plan = _plan(_shape(), available=1000 * MB, resident_layers=3)
    assert plan.resident_layers == 3 and plan.resident_layer_bytes == 30 * MB
    assert plan.stream_buffer_bytes == 3 * 10 * MB  # (prefetch depth 2 + 1) x the largest


def _plan_under_a_cap(
    monkeypatch,
    config,
    layers: int,
    *,
    kv_bytes_per_token: int,
    context: int,
    activations: int = 0,
):
    """apply_memory_plan under a 1.2 GB cgroup for `layers` MoE layers of 64 experts
    of 3 MB (top-8), with MLX's pool limit put back after."""
    import mlx.core as mx

    from flashserve.engine.streaming import memplan
    from flashserve.engine.streaming.memory import SystemMemory

    monkeypatch.setattr(
        memplan, "system_memory", lambda: SystemMemory(1200 * MB, 1100 * MB, "cgroup v1 /x")
    )
    switch = {"num_experts": 64, "record_bytes": 3 * MB}
    manifest = {"layers": [{"experts": {"switches": [switch]}} for _ in range(layers)]}
    limit = mx.set_cache_limit(0)
    try:
        return memplan.apply_memory_plan(
            config,
            manifest,
            {"num_experts_per_tok": 8},
            layer_bytes=[10 * MB] * layers,
            kv_bytes_per_token=kv_bytes_per_token,
            context_length=context,
            activations=lambda: activations,
        )
    finally:
        mx.set_cache_limit(limit)


@pytest.mark.parametrize(
    ("layers", "asked", "expected"),
    [(16, "auto", "next-layer"), (2, "auto", "none"), (16, "none", "none")],
)
def test_auto_prefetch_reads_ahead_when_the_experts_do_not_all_fit(
    monkeypatch, layers, asked, expected
) -> None:
    """Its reads come out of the cache's bytes (experts/prefetch.py), so the plan
    turns it on when decode reads experts from disk; a choice made is kept."""
    from flashserve.engine.config import EngineConfig

    config = EngineConfig(model="x", expert_cache="auto", expert_prefetch=asked)
    plan = _plan_under_a_cap(monkeypatch, config, layers, kv_bytes_per_token=1024, context=2048)
    assert config.expert_prefetch == expected
    said = any("next-layer expert prefetch on" in r for r in plan.reasons)
    assert said == (expected == "next-layer" and asked == "auto")


CAP = 400 * MB


def test_auto_plan_under_a_cgroup_limit_serves_within_it(tmp_path_factory, tmp_path) -> None:
    prepared = big_moe(tmp_path_factory)
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["total_bytes"] > CAP // 2
    group = _make_group(CAP)
    server = None
    try:
        server = _start_in_group(
            group,
            prepared,
            tmp_path,
            "--expert-cache",
            "auto",
            "--prompt-cache-bytes",
            "1GB",
            "--prompt-cache-dir",
            str(tmp_path / "prompt-cache"),
        )
        http = server.http(timeout=300)
        memory = http.get("/memory").json()
        plan = memory["memory_plan"]
        assert plan["limit_bytes"] == CAP
        assert plan["limit_source"] == f"cgroup v1 {group}"
        # The experts do not all fit: the cache takes what the limit leaves them.
        assert 2 * 8 * 0.4 * MB < plan["expert_cache_bytes"] < plan["expert_total_bytes"]
        assert plan["shed_floor_bytes"] < 300_000_000
        log = server.log_tail(200_000)
        assert "memory plan: limit 400.00 MB (cgroup v1" in log
        assert "memory plan: dense layers resident first" in log
        stats = http.get("/cache/stats").json()
        assert stats["capacity_bytes"] == plan["expert_cache_bytes"]
        prompt = [20 + i % 280 for i in range(600)]  # the tiny vocabulary has 320 tokens
        for _ in range(2):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logit_bias": NO_EOS}
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 24
            prompt = [*prompt, *range(300, 310)]
        memory = http.get("/memory").json()
        assert memory["shedding_events"] == []  # the plan left room: nothing was shed
        assert 0 < memory["expert_cache_bytes"] <= plan["expert_cache_bytes"]
        assert memory["overhead_bytes"] > 0
        assert server.process.poll() is None  # not killed
        assert "oom_kill 0" in (group / "memory.oom_control").read_text()
        assert int((group / "memory.max_usage_in_bytes").read_text()) <= CAP
    finally:
        if server is not None:
            stop_server(server)
        _remove_group(group)


def test_a_lent_prefill_room_holds_a_group_of_half_the_expert_cache(monkeypatch) -> None:
    """Each group of a layer-major prefill reads every expert once: with the room
    lent, a group may hold hidden states up to half the expert cache, not 4% of
    the limit (which cut a 632-token prompt into three groups under 1.2 GB)."""
    from flashserve.engine.config import EngineConfig

    config = EngineConfig(model="x", expert_cache="auto")
    plan = _plan_under_a_cap(
        monkeypatch, config, 16, kv_bytes_per_token=64 * 1024, context=4096, activations=40 * MB
    )
    assert plan.expert_cache_bytes < 16 * 64 * 3 * MB  # the experts do not all fit: lent
    assert config.prefill_group_bytes == plan.expert_cache_bytes // 2
    assert plan.prefill_reserve_bytes == 40 * MB + config.prefill_group_bytes
    assert any("half the expert cache" in r for r in plan.reasons)
