"""Residency plan math, placements and shedding (no model needed: pure policy)."""

from __future__ import annotations

import math

import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.streaming.residency import ResidencyManager, place, plan_residency
from flashserve.engine.weights.model import ModelLoadError

MB = 1024 * 1024
GB = 1024 * MB


def test_placements():
    assert place(3, 8, "first_n") == [0, 1, 2]
    assert place(3, 8, "last_n") == [5, 6, 7]
    assert place(4, 8, "interleaved") == [0, 2, 4, 6]
    assert place(3, 12, "interleaved") == [0, 4, 8]
    assert place(5, 8, "interleaved") == [0, 1, 3, 4, 6]
    assert len(set(place(7, 8, "interleaved"))) == 7
    for placement in ("first_n", "last_n", "interleaved"):
        assert place(0, 8, placement) == []
        assert place(8, 8, placement) == list(range(8))
        assert place(99, 8, placement) == list(range(8))
    with pytest.raises(ModelLoadError, match="placement"):
        place(2, 8, "random")


def test_all_and_fixed():
    sizes = [100 * MB] * 10
    plan = plan_residency(EngineConfig(), layer_bytes=sizes, non_layer_bytes=50 * MB)
    assert plan.resident_layers == list(range(10)) and plan.streamed_layers == []
    assert plan.inputs.policy == "all" and plan.inputs.stream_buffer_bytes == 0

    plan = plan_residency(
        EngineConfig(resident_layers=4, placement="last_n", prefetch_depth=2),
        layer_bytes=sizes,
        non_layer_bytes=50 * MB,
    )
    assert plan.resident_count == 4
    assert plan.resident_layers == [6, 7, 8, 9]
    assert plan.streamed_layers == [0, 1, 2, 3, 4, 5]
    assert plan.inputs.policy == "fixed"
    assert plan.inputs.stream_buffer_bytes == 3 * 100 * MB
    assert "4/10 layers resident [6-9]" in plan.describe()
    with pytest.raises(ModelLoadError):
        plan_residency(EngineConfig(resident_layers=-1), layer_bytes=sizes, non_layer_bytes=1)


def test_auto_modes_follow_the_formula():
    sizes = [200 * MB] * 40
    non_layer, runtime, per_token = 300 * MB, 512 * MB, 64 * 1024
    available = 6 * GB
    counts = {}
    for mode, tokens in (("max_tps", 512), ("balanced", 1024), ("max_context", 32768)):
        plan = plan_residency(
            EngineConfig(residency="auto", residency_mode=mode, prefetch_depth=1),
            layer_bytes=sizes,
            non_layer_bytes=non_layer,
            kv_bytes_per_token=per_token,
            context_length=32768,
            runtime_reserve=runtime,
            probe=lambda: available,
        )
        w = 200 * MB
        kv = tokens * per_token
        expected = math.floor((available - non_layer - 2 * w - runtime - kv) / w * 0.9)
        assert plan.resident_count == expected, mode
        assert plan.inputs.kv_reserve_tokens == tokens
        assert plan.inputs.kv_reserve_bytes == kv
        assert plan.inputs.available_bytes == available
        assert plan.inputs.runtime_reserve_bytes == runtime
        counts[mode] = plan.resident_count
    # More KV reserve, fewer resident layers.
    assert counts["max_tps"] >= counts["balanced"] > counts["max_context"] >= 0


def test_auto_clamps():
    sizes = [10 * MB] * 8
    plenty = plan_residency(
        EngineConfig(residency="auto"), layer_bytes=sizes, non_layer_bytes=MB, probe=lambda: 64 * GB
    )
    assert plenty.resident_count == 8
    starved = plan_residency(
        EngineConfig(residency="auto"),
        layer_bytes=sizes,
        non_layer_bytes=MB,
        probe=lambda: 100 * MB,
    )
    assert starved.resident_count == 0 and starved.streamed_layers == list(range(8))
    with pytest.raises(ModelLoadError, match="mode"):
        plan_residency(
            EngineConfig(residency="auto", residency_mode="fast"),
            layer_bytes=sizes,
            non_layer_bytes=MB,
            probe=lambda: GB,
        )


def test_memory_budget():
    sizes = [100 * MB] * 10
    # non-layer 50 MB + buffers (depth 1: 2 x 100 MB) + 3 layers = 550 MB
    plan = plan_residency(
        EngineConfig(memory_budget=560 * MB, prefetch_depth=1, placement="interleaved"),
        layer_bytes=sizes,
        non_layer_bytes=50 * MB,
    )
    assert plan.resident_count == 3
    assert plan.resident_layers == [0, 3, 6]
    assert plan.inputs.memory_budget == 560 * MB
    # Enough for everything: no buffers needed.
    plan = plan_residency(
        EngineConfig(memory_budget=1050 * MB), layer_bytes=sizes, non_layer_bytes=50 * MB
    )
    assert plan.resident_count == 10
    # Above the non-layer weights but below the buffers: stream everything.
    plan = plan_residency(
        EngineConfig(memory_budget=60 * MB), layer_bytes=sizes, non_layer_bytes=50 * MB
    )
    assert plan.resident_count == 0


def test_budget_below_non_layer_is_refused_with_numbers():
    with pytest.raises(ModelLoadError) as info:
        plan_residency(
            EngineConfig(memory_budget=40 * MB), layer_bytes=[MB] * 4, non_layer_bytes=50 * MB
        )
    message = str(info.value)
    assert str(40 * MB) in message and str(50 * MB) in message
    assert "40.00 MB" in message and "50.00 MB" in message


class FakeModel:
    """Stands in for the streamer: which layers are resident, and demotion."""

    def __init__(self, count: int):
        self.resident = list(range(count))
        self.demoted: list[list[int]] = []

    def demote(self, indices: list[int]) -> None:
        self.demoted.append(list(indices))
        self.resident = [i for i in self.resident if i not in indices]


def test_shedding_sheds_a_quarter_highest_first():
    fake = FakeModel(10)
    available = {"bytes": 10 * GB}
    manager = ResidencyManager(
        demote=fake.demote,
        resident=lambda: fake.resident,
        floor=300 * MB,
        probe=lambda: available["bytes"],
    )
    assert manager.check() is None  # plenty
    available["bytes"] = 200 * MB
    event = manager.check()
    assert event.shed_layers == [9, 8, 7]  # ceil(25% of 10), highest first
    assert event.resident_after == 7
    assert event.available_bytes == 200 * MB and event.floor_bytes == 300 * MB
    assert manager.check().shed_layers == [6, 5]  # ceil(25% of 7)
    assert fake.resident == [0, 1, 2, 3, 4]
    while fake.resident:
        manager.check()
    assert manager.check() is None  # nothing left: no crash, no event
    assert [len(e.shed_layers) for e in manager.events] == [3, 2, 2, 1, 1, 1]


def test_shedding_every_64_tokens():
    fake = FakeModel(4)
    manager = ResidencyManager(
        demote=fake.demote, resident=lambda: fake.resident, floor=GB, probe=lambda: 0
    )
    results = [manager.on_tokens(1) for _ in range(200)]
    fired = [i + 1 for i, r in enumerate(results) if r is not None]
    assert fired == [64, 128, 192]
    assert fake.demoted == [[3], [2], [1]]


def test_pressure_hooks_run_first():
    fake = FakeModel(4)
    available = {"bytes": 100 * MB}

    def hook(deficit: int) -> int:
        assert deficit == 200 * MB
        available["bytes"] = 400 * MB  # the expert cache gave memory back
        return 300 * MB

    manager = ResidencyManager(
        demote=fake.demote,
        resident=lambda: fake.resident,
        floor=300 * MB,
        probe=lambda: available["bytes"],
    )
    manager.add_pressure_hook(hook)
    event = manager.check()
    assert event.shed_layers == [] and event.freed_by_hooks == 300 * MB
    assert fake.resident == [0, 1, 2, 3]


def test_shedding_never_raises():
    def broken_demote(indices):
        raise RuntimeError("boom")

    manager = ResidencyManager(
        demote=broken_demote, resident=lambda: [0, 1], floor=GB, probe=lambda: 0
    )
    assert manager.check() is None

    def broken_probe():
        raise OSError("no /proc")

    manager = ResidencyManager(
        demote=broken_demote, resident=lambda: [0], floor=GB, probe=broken_probe
    )
    assert manager.on_tokens(64) is None
