"""The loaded models: one Engine (its own worker thread) per model, loaded on first use.

Why one worker per model: a request to a small resident model never waits for
a big streamed model's decode step or prefill (each worker steps its own
batch; MLX gives every thread its own default stream, so their graphs run
side by side, and the kernel's thread pool serves one matmul at a time, the
other running on its caller's thread). One worker scheduling several engines
would put the small model's step behind the big one's.

Loads run one at a time (an asyncio lock): before one, idle models are
unloaded, least recently used first, until the new model's estimated memory
fits what the system has available (the cgroup limit or RAM, as memory plans
read it) and `max_loaded` allows it. A model with a request in flight or
leased (resolved by a route, not yet submitted) is never unloaded, nor a
pinned one. A load that fails answers the requests waiting for it with its
reason; the other models keep serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from flashserve.engine.compute import heap
from flashserve.engine.generation import fairness
from flashserve.engine.generation.worker import Engine
from flashserve.engine.models.catalog import ModelEntry
from flashserve.engine.streaming.memory import memory_report, process_private, system_memory

log = logging.getLogger(__name__)

# What a resident model needs beyond its weights on disk: a GGUF's blocks become
# MLX's affine groups (scales and biases per 32: ~1.1x a Q4_0 file), plus its
# runtime and a first prompt's activations and KV.
GGUF_GROWTH = 1.15
RUNTIME_BYTES = 128 * 1024 * 1024
IDLE_CHECK_S = 1.0
RELEASE_WAIT_S = 5.0  # an unloaded model's memory, waited for (see unload)


class UnknownModelError(LookupError):
    """No model of that name (or alias)."""


class ModelUnavailableError(RuntimeError):
    """The model could not be loaded (or made room for); the message says why.
    `transient`: it may load later (every loaded model was busy)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


@dataclass
class Slot:
    """One entry's state in the pool."""

    entry: ModelEntry
    engine: Engine | None = None
    state: str = "not loaded"  # not loaded | loading | loaded | failed
    error: str | None = None  # the last load's failure
    leases: int = 0  # routes holding it between resolving and submitting
    last_used: float = 0.0  # monotonic
    resident_bytes: int = 0  # private memory its load added (measured)
    weight_bytes: int = 0  # its resident weights (a small model's load may reuse freed heap)
    load_s: float = 0.0  # the last load's time

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.engine is not None and not self.engine.idle)


def _weight_bytes(engine: Engine) -> int:
    """The loaded model's resident weights (reads sizes only: safe off the worker)."""
    loaded = getattr(engine, "loaded", None)
    if loaded is None:
        return 0
    return int(memory_report(loaded).resident_weight_bytes)


def need_bytes(entry: ModelEntry) -> int:
    """Memory a model is expected to take once loaded. A streamed model (residency
    auto, an expert cache, a budget) plans itself into what is available, so this is
    what it would like, not what it must have."""
    weights = entry.disk_bytes
    if Path(str(entry.config.model or "")).suffix.lower() == ".gguf":
        weights = int(weights * GGUF_GROWTH)
    return weights + RUNTIME_BYTES


def adapts(entry: ModelEntry) -> bool:
    """Whether the model's memory plan fits it into less than its whole size."""
    config = entry.config
    return config.residency != "all" or bool(config.expert_cache) or bool(config.memory_budget)


class ModelPool:
    def __init__(
        self,
        entries: list[ModelEntry],
        default: str | None = None,
        *,
        max_loaded: int = 0,
        idle_unload: float = 0.0,
        engine_factory: Callable[[ModelEntry], Engine] | None = None,
    ):
        self.slots = {e.name: Slot(e) for e in entries}
        self._names = {n: e.name for e in entries for n in e.names | {e.name}}
        self.default = default  # loaded at start, answers requests naming no model
        self.max_loaded = max_loaded  # 0: as many as fit
        self.idle_unload = idle_unload  # seconds; 0: never
        self._factory = engine_factory or (lambda entry: Engine(entry.config))
        self._load_lock: asyncio.Lock | None = None  # made on the event loop
        self._idle_task: asyncio.Task | None = None
        self.loads = 0
        self.unloads = 0

    # -- lookup --------------------------------------------------------------------

    def resolve(self, name: str | None) -> Slot:
        """The slot for a request's `model` (id or alias). None: the default model, else
        the one most recently used, else the first."""
        if name is None:
            return self.current_slot() or next(iter(self.slots.values()))
        key = self._names.get(name)
        if key is None:
            raise UnknownModelError(name)
        return self.slots[key]

    def current_slot(self) -> Slot | None:
        """The default model's slot, else the most recently used loaded one."""
        if self.default is not None:
            return self.slots[self.default]
        loaded = [s for s in self.slots.values() if s.engine is not None]
        return max(loaded, key=lambda s: s.last_used) if loaded else None

    def engines(self) -> list[tuple[str, Engine]]:
        """Every model with an engine (loading, ready or failed), by name."""
        return [(n, s.engine) for n, s in self.slots.items() if s.engine is not None]

    # -- start and stop ------------------------------------------------------------

    def adopt(self, name: str, engine: Engine) -> None:
        """An engine made by the caller (the --model's) becomes this slot's; the app
        starts it, so its load answers 503 while it runs, as a one-model server does."""
        slot = self.slots[name]
        slot.engine, slot.state, slot.last_used = engine, "loading", time.monotonic()

    def start(self) -> None:
        """Start the adopted engines and the idle watcher (on the event loop)."""
        self._load_lock = asyncio.Lock()
        for slot in self.slots.values():
            if slot.engine is not None:
                slot.engine.start()
        if self.idle_unload > 0:
            self._idle_task = asyncio.get_running_loop().create_task(self._watch_idle())

    def stop(self) -> None:
        """Stop every worker (blocking: call it off the event loop)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
        for slot in self.slots.values():
            if slot.engine is not None:
                slot.engine.shutdown()

    # -- use -----------------------------------------------------------------------

    @asynccontextmanager
    async def lease(self, name: str | None, timeout: float | None = None) -> AsyncIterator[Engine]:
        """The model's engine, loaded first if it is not; while held, the model is not
        unloaded (a route holds it until its request is submitted, after which the
        engine's own count of requests in flight keeps it)."""
        slot = self.resolve(name)
        slot.leases += 1
        slot.last_used = time.monotonic()
        try:
            if slot.engine is None or slot.state == "failed":
                await asyncio.wait_for(self._load(slot), timeout)
            assert slot.engine is not None
            yield slot.engine
        except TimeoutError:
            raise ModelUnavailableError(
                f"model {slot.entry.name} did not finish loading within {timeout:g} s"
            ) from None
        finally:
            slot.leases -= 1
            slot.last_used = time.monotonic()

    async def _load(self, slot: Slot) -> None:
        assert self._load_lock is not None, "ModelPool.start() was not called"
        async with self._load_lock:  # loads never run two at a time
            if slot.engine is not None and slot.state == "loaded":
                return  # loaded while this request waited for the lock
            if slot.engine is not None:  # a failed engine: its worker has ended
                await asyncio.to_thread(_release, slot.engine)
                slot.engine = None
            await self._make_room(slot)
            slot.state, slot.error = "loading", None
            before = process_private()
            start = time.perf_counter()
            engine = self._factory(slot.entry)
            slot.engine = engine
            engine.start()
            ready = await asyncio.to_thread(engine.wait_ready)
            slot.load_s = time.perf_counter() - start
            if not ready:
                slot.state, slot.error = "failed", engine.load_error or "the model failed to load"
                log.error("model %s failed to load: %s", slot.entry.name, slot.error)
                await asyncio.to_thread(_release, engine)
                slot.engine = None
                raise ModelUnavailableError(f"model {slot.entry.name} failed to load: {slot.error}")
            slot.state = "loaded"
            slot.resident_bytes = max(0, process_private() - before)
            slot.weight_bytes = _weight_bytes(engine)
            self.loads += 1
            log.info(
                "model %s loaded in %.1f s (%.0f MB private)",
                slot.entry.name,
                slot.load_s,
                slot.resident_bytes / 1e6,
            )

    async def _make_room(self, slot: Slot) -> None:
        """Unload idle models, least recently used first, until the new one fits."""
        need = need_bytes(slot.entry)
        while True:
            loaded = [s for s in self.slots.values() if s.engine is not None and s is not slot]
            over_count = self.max_loaded > 0 and len(loaded) >= self.max_loaded
            available = system_memory().available
            if not over_count and available >= need:
                return
            victims = sorted(
                (s for s in loaded if not s.busy and not s.entry.pinned), key=lambda s: s.last_used
            )
            if not victims:
                break
            why = f"{self.max_loaded} loaded at most" if over_count else "memory"
            await self.unload(victims[0].entry.name, f"room for {slot.entry.name} ({why})")
        if over_count:
            raise ModelUnavailableError(
                f"model {slot.entry.name} cannot load: {self.max_loaded} models are loaded "
                "(models_max) and none of them is idle; retry later",
                transient=True,
            )
        total = system_memory().total
        if not adapts(slot.entry) and need > total:
            raise ModelUnavailableError(
                f"model {slot.entry.name} does not fit: it needs about {need / 1e6:.0f} MB, "
                f"and the memory limit is {total / 1e6:.0f} MB"
            )
        if not adapts(slot.entry) and loaded:  # beside them it would exhaust memory
            names = ", ".join(s.entry.name for s in loaded)
            raise ModelUnavailableError(
                f"model {slot.entry.name} needs about {need / 1e6:.0f} MB and "
                f"{available / 1e6:.0f} MB are available beside {names} (busy or pinned); "
                "retry later",
                transient=any(s.busy for s in loaded),
            )
        log.warning(
            "model %s needs about %.0f MB and %.0f MB are available: loading it anyway%s",
            slot.entry.name,
            need / 1e6,
            available / 1e6,
            " (its memory plan adapts)" if adapts(slot.entry) else "",
        )

    async def unload(self, name: str, why: str) -> int:
        """Stop a model's worker and give its memory back; the private bytes freed."""
        slot = self.slots[name]
        engine = slot.engine
        if engine is None:
            return 0
        slot.engine, slot.state = None, "not loaded"
        before = process_private()
        await asyncio.to_thread(_release, engine)
        del engine
        # A stream that just ended may still hold the model (its response's generator
        # is finalized a moment after the client read the last event): wait for it.
        deadline = time.monotonic() + RELEASE_WAIT_S
        while before - process_private() < slot.resident_bytes / 2:
            if time.monotonic() > deadline:
                log.warning("model %s: its memory was not given back yet", name)
                break
            await asyncio.sleep(0.1)
            await asyncio.to_thread(_collect)
        freed = max(0, before - process_private())
        self.unloads += 1
        log.info("model %s unloaded (%s): %.0f MB freed", name, why, freed / 1e6)
        return freed

    async def _watch_idle(self) -> None:
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, self.idle_unload / 4))
            now = time.monotonic()
            for name, slot in self.slots.items():
                if slot.busy:
                    slot.last_used = now  # in use: idle from when it ends
                elif (
                    slot.engine is not None
                    and slot.state == "loaded"
                    and not slot.entry.pinned
                    and now - slot.last_used >= self.idle_unload
                ):
                    async with self._lock():
                        if not slot.busy and slot.engine is not None:
                            await self.unload(name, f"idle {self.idle_unload:g} s")

    def _lock(self) -> asyncio.Lock:
        assert self._load_lock is not None
        return self._load_lock

    def numbers(self) -> dict:
        """/metrics: how many models are loaded, the loads and unloads so far, and the
        time decode steps waited for another model's prefill (generation/fairness.py)."""
        loaded = sum(1 for s in self.slots.values() if s.engine is not None)
        return {"loaded": loaded, "known": len(self.slots), "loads_total": self.loads,
                "unloads_total": self.unloads,
                "decode_wait_seconds_total": fairness.board.waited_s}  # fmt: skip

    def describe(self) -> list[dict]:
        """Each model's state for /v1/models and /memory."""
        out = []
        for name, slot in self.slots.items():
            state = slot.state
            if slot.engine is not None and slot.engine.state == "ready":
                state = "loaded"
            elif slot.engine is not None and slot.engine.state == "loading":
                state = "loading"
            out.append(
                {
                    "id": name,
                    "state": state,
                    "aliases": list(slot.entry.aliases),
                    "pinned": slot.entry.pinned,
                    "size_bytes": slot.entry.disk_bytes,
                    "memory_bytes": (
                        max(slot.resident_bytes, slot.weight_bytes) if state == "loaded" else None
                    ),
                    "load_seconds": round(slot.load_s, 3) if slot.load_s else None,
                    "error": slot.error,
                }
            )
        return out


def _release(engine: Engine) -> None:
    """Stop the worker, drop what it held, and give the memory back to the system."""
    engine.shutdown(release=True)
    _collect()


def _collect() -> None:
    gc.collect()
    mx.clear_cache()
    heap.trim(always=True)
