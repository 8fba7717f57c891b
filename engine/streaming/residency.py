"""Which decoder layers stay resident, and shedding under memory pressure.

Policies (from EngineConfig):
  all      every layer resident (the default)
  fixed    `resident_layers` N
  budget   `memory_budget` bytes for weights: non-layer + resident layers +
           streaming buffers must fit
  auto     from available memory (seed paper, eq. 2):
             N = floor((M_avail - O - B - R_runtime - KV_reserve - P) / w * 0.9)
           O: non-layer bytes, w: largest layer, B: streaming buffers
           ((prefetch_depth + 1) * w; the paper's single `w` is depth 0),
           KV_reserve: KV bytes for 512 (max_tps), 1024 (balanced) or the
           full context (max_context) tokens; P: the prompt cache's budget.
Placement turns N into layer indices: first_n | last_n | interleaved.

Shedding: every 64 generated tokens the worker asks the manager; when
available memory is under the floor, pressure hooks (the expert cache) give
memory back first, then 25% of the resident layers, highest index first,
become streamed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from flashserve.engine.config import EngineConfig
from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

# "auto": interleaved under the dense memory plan (denseplan.py apply_dense_plan),
# first_n elsewhere.
PLACEMENTS = ("auto", "first_n", "last_n", "interleaved")
MODES = {"max_tps": 512, "balanced": 1024, "max_context": None}  # KV reserve tokens
SAFETY = 0.9  # the paper's factor on the layer count
SHED_FRACTION = 0.25
CHECK_INTERVAL = 64  # generated tokens between memory checks
DEFAULT_RUNTIME_BASE = 256 * 1024 * 1024


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class PlanInputs:
    policy: str  # all | fixed | budget | auto
    placement: str
    num_layers: int
    non_layer_bytes: int  # O
    layer_bytes: list[int]  # per layer, as streamed (experts included while they travel)
    largest_layer_bytes: int  # w
    prefetch_depth: int
    stream_buffer_bytes: int = 0  # B = (prefetch_depth + 1) * w when any layer streams
    requested_layers: int | None = None
    memory_budget: int | None = None
    mode: str | None = None
    available_bytes: int | None = None  # M_avail at plan time
    available_source: str | None = None  # what bounds it: "host" or the cgroup
    runtime_reserve_bytes: int | None = None  # R_runtime
    kv_bytes_per_token: int = 0
    kv_reserve_tokens: int | None = None
    kv_reserve_bytes: int | None = None
    prompt_cache_bytes: int = 0  # the prompt cache's budget, kept free of layers


@dataclass
class ResidencyPlan:
    resident_count: int  # N
    resident_layers: list[int]
    streamed_layers: list[int]
    inputs: PlanInputs

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        i = self.inputs
        text = (
            f"residency plan ({i.policy}, {i.placement}): {self.resident_count}/{i.num_layers} "
            f"layers resident {_ranges(self.resident_layers)}, "
            f"streamed {_ranges(self.streamed_layers)}; "
            f"non-layer {fmt_bytes(i.non_layer_bytes)}, "
            f"largest layer {fmt_bytes(i.largest_layer_bytes)}, "
            f"prefetch depth {i.prefetch_depth}"
        )
        if i.memory_budget is not None:
            text += f", budget {fmt_bytes(i.memory_budget)}"
        if i.available_bytes is not None:
            text += (
                f", mode {i.mode}: available {fmt_bytes(i.available_bytes)}"
                + (f" ({i.available_source})" if i.available_source else "")
                + ", runtime reserve "
                f"{fmt_bytes(i.runtime_reserve_bytes or 0)}, KV reserve "
                f"{fmt_bytes(i.kv_reserve_bytes or 0)} ({i.kv_reserve_tokens} tokens), "
                f"prompt cache {fmt_bytes(i.prompt_cache_bytes)}"
            )
        return text


def _ranges(indices: list[int]) -> str:
    if not indices:
        return "[]"
    parts, start = [], indices[0]
    for prev, cur in zip(indices, [*indices[1:], None], strict=True):
        if cur is None or cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return "[" + ",".join(parts) + "]"


def place(count: int, num_layers: int, placement: str) -> list[int]:
    """Indices of `count` resident layers out of `num_layers`."""
    count = max(0, min(count, num_layers))
    if placement in ("first_n", "auto"):
        return list(range(count))
    if placement == "last_n":
        return list(range(num_layers - count, num_layers))
    if placement == "interleaved":
        # Evenly spread, so streamed layers alternate with resident ones and
        # each load overlaps the compute of the resident layers before it.
        return sorted({(k * num_layers) // count for k in range(count)}) if count else []
    raise ModelLoadError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


def plan_residency(
    config: EngineConfig,
    *,
    layer_bytes: list[int],
    non_layer_bytes: int,
    kv_bytes_per_token: int = 0,
    context_length: int = 4096,
    runtime_reserve: int = DEFAULT_RUNTIME_BASE,
    probe: Callable[[], int] | None = None,
) -> ResidencyPlan:
    """Decide N and the resident layer indices; raise ModelLoadError on impossible input."""
    num_layers = len(layer_bytes)
    w = max(layer_bytes) if layer_bytes else 0
    depth = max(0, int(config.prefetch_depth))
    if config.placement not in PLACEMENTS:
        raise ModelLoadError(
            f"placement must be one of {', '.join(PLACEMENTS)}, got {config.placement!r}"
        )
    inputs = PlanInputs(
        policy="all",
        placement=config.placement,
        num_layers=num_layers,
        non_layer_bytes=non_layer_bytes,
        layer_bytes=list(layer_bytes),
        largest_layer_bytes=w,
        prefetch_depth=depth,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    buffers = (depth + 1) * w

    if config.resident_layers is not None:
        if config.resident_layers < 0:
            raise ModelLoadError(f"resident_layers must be >= 0, got {config.resident_layers}")
        inputs.policy = "fixed"
        inputs.requested_layers = config.resident_layers
        count = min(config.resident_layers, num_layers)
    elif config.memory_budget is not None:
        inputs.policy = "budget"
        inputs.memory_budget = budget = int(config.memory_budget)
        if budget < non_layer_bytes:
            raise ModelLoadError(
                f"memory budget {fmt_bytes(budget)} ({budget} bytes) is smaller than the "
                f"non-layer weights {fmt_bytes(non_layer_bytes)} ({non_layer_bytes} bytes), "
                "which are always resident"
            )
        count = _fit(budget - non_layer_bytes, layer_bytes, config.placement, buffers)
        _warn_over_limit(budget, probe)
        if count < num_layers and budget < non_layer_bytes + buffers:
            log.warning(
                "memory budget %s cannot hold the non-layer weights (%s) plus the streaming "
                "buffers (%s): streaming every layer anyway",
                fmt_bytes(budget),
                fmt_bytes(non_layer_bytes),
                fmt_bytes(buffers),
            )
    elif config.residency == "auto":
        mode = config.residency_mode
        if mode not in MODES:
            raise ModelLoadError(f"residency mode must be one of {', '.join(MODES)}, got {mode!r}")
        from flashserve.engine.streaming.memory import system_memory

        if probe is None:
            memory = system_memory()  # the host's, or the cgroup's when tighter
            available = memory.available
            inputs.available_source = memory.limit_source
        else:
            available = int(probe())
        tokens = MODES[mode] or context_length
        kv_reserve = tokens * kv_bytes_per_token
        inputs.policy = "auto"
        inputs.mode = mode
        inputs.available_bytes = available
        inputs.runtime_reserve_bytes = runtime_reserve
        inputs.kv_reserve_tokens = tokens
        inputs.kv_reserve_bytes = kv_reserve
        inputs.prompt_cache_bytes = prompt_cache = int(config.prompt_cache_bytes)
        free = available - non_layer_bytes - runtime_reserve - kv_reserve - prompt_cache
        if w == 0:
            count = num_layers
        else:
            count = min(num_layers, max(0, math.floor((free - buffers) / w * SAFETY)))
    elif config.residency in ("all", None):
        count = num_layers
    else:
        raise ModelLoadError(
            f"residency must be all, fixed (with resident_layers) or auto, got {config.residency!r}"
        )

    if count < num_layers:
        inputs.stream_buffer_bytes = buffers
    resident = place(count, num_layers, config.placement)
    streamed = [i for i in range(num_layers) if i not in set(resident)]
    return ResidencyPlan(len(resident), resident, streamed, inputs)


def _warn_over_limit(budget: int, probe: Callable[[], int] | None) -> None:
    """A budget past the memory this process may use (host or cgroup) ends in swapping
    or the OOM killer; say so at load rather than after."""
    if probe is not None:  # planning against a given probe (tests, tools): no real limit
        return
    from flashserve.engine.streaming.memory import system_memory

    memory = system_memory()
    if budget > memory.total:
        log.warning(
            "memory budget %s is larger than the memory limit %s (%s)",
            fmt_bytes(budget),
            fmt_bytes(memory.total),
            memory.limit_source,
        )


def _fit(room: int, layer_bytes: list[int], placement: str, buffers: int) -> int:
    """Largest N whose placed layers (plus buffers, when any layer streams) fit in `room`."""
    num_layers = len(layer_bytes)
    if sum(layer_bytes) <= room:
        return num_layers
    for count in range(num_layers - 1, -1, -1):
        need = sum(layer_bytes[i] for i in place(count, num_layers, placement)) + buffers
        if need <= room:
            return count
    return 0


@dataclass
class ShedEvent:
    time: float  # unix seconds
    available_bytes: int
    floor_bytes: int
    shed_layers: list[int]  # layers turned from resident to streamed
    resident_after: int
    freed_by_hooks: int = 0  # bytes the pressure hooks (expert cache) gave back
    note: str = ""


@dataclass
class ResidencyManager:
    """Shedding under memory pressure; owned by the streamer, driven by the worker.

    `demote(indices)` turns resident layers into streamed ones; `resident()`
    lists the currently resident layers; `probe()` returns available bytes.
    Call `check()` from the thread that runs the model (it frees MLX memory).
    """

    demote: Callable[[list[int]], None]
    resident: Callable[[], list[int]]
    floor: int
    probe: Callable[[], int] | None = None
    events: list[ShedEvent] = field(default_factory=list)
    pressure_hooks: list[Callable[[int], int]] = field(default_factory=list)
    interval: int = CHECK_INTERVAL
    _tokens: int = 0
    _warned_empty: bool = False

    def add_pressure_hook(self, hook: Callable[[int], int]) -> None:
        """`hook(deficit_bytes) -> freed_bytes` runs before any layer is shed."""
        self.pressure_hooks.append(hook)

    def on_tokens(self, count: int = 1) -> ShedEvent | None:
        """Count generated tokens; check memory every `interval` of them."""
        self._tokens += count
        if self._tokens < self.interval:
            return None
        self._tokens %= self.interval
        return self.check()

    def check(self) -> ShedEvent | None:
        """Shed if available memory is under the floor. Never raises."""
        try:
            return self._check()
        except Exception:  # shedding is best effort; generation must go on
            log.exception("memory check failed")
            return None

    def _available(self) -> int:
        if self.probe is not None:
            return int(self.probe())
        from flashserve.engine.streaming.memory import available_memory

        return available_memory()

    def shed(self, deficit: int) -> ShedEvent | None:
        """Give back about `deficit` bytes now, whatever available memory says (the
        worker saw this process read far more from disk than its plan: something
        else took the plan's room). The pressure hooks first, then layers. Never
        raises."""
        try:
            return self._give_back(self._available(), max(int(deficit), 1), forced=True)
        except Exception:
            log.exception("shedding failed")
            return None

    def _check(self) -> ShedEvent | None:
        available = self._available()
        if available >= self.floor:
            return None
        return self._give_back(available, self.floor - available, forced=False)

    def _give_back(self, available: int, deficit: int, forced: bool) -> ShedEvent | None:
        freed = 0
        for hook in self.pressure_hooks:
            freed += int(hook(deficit) or 0)
        if freed:
            available = self._available()
            if (freed >= deficit) if forced else (available >= self.floor):
                event = ShedEvent(
                    time.time(),
                    available,
                    self.floor,
                    [],
                    len(self.resident()),
                    freed,
                    "pressure hooks freed enough",
                )
                self.events.append(event)
                log.warning("memory pressure: hooks freed %s", fmt_bytes(freed))
                return event
        resident = sorted(self.resident())
        if not resident:
            if not self._warned_empty:
                log.warning(
                    "available memory %s is under the floor %s "
                    "and no resident layer is left to shed",
                    fmt_bytes(available),
                    fmt_bytes(self.floor),
                )
                self._warned_empty = True
            return None
        count = max(1, math.ceil(len(resident) * SHED_FRACTION))
        victims = resident[-count:][::-1]  # highest index first
        self.demote(victims)
        event = ShedEvent(
            time=time.time(),
            available_bytes=available,
            floor_bytes=self.floor,
            shed_layers=victims,
            resident_after=len(self.resident()),
            freed_by_hooks=freed,
            note="reads past the plan" if forced else "",
        )
        self.events.append(event)
        log.warning(
            "memory pressure: available %s%s; shed %d resident layers %s (%d left resident)",
            fmt_bytes(available),
            " (reads past the plan)" if forced else f" < floor {fmt_bytes(self.floor)}",
            len(victims),
            victims,
            event.resident_after,
        )
        return event
