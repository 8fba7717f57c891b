"""What the worker watches to serve inside a memory plan.

* KV admission. The dense memory plan (streaming/denseplan.py) reserves KV
  for the memory-bound context, and for the whole batch as many tokens as the
  limit holds (`kv_budget_tokens`, at least that context). A request that
  needs more than the context on its own is refused by the server before it
  gets here (the context-length error of its dialect: loaded.context_length
  is that bound). Requests that fit alone but not beside the batch wait in the
  queue, first come first served, until enough of the batch has ended: the KV
  of every sequence in the batch (its prompt and its whole answer, one per
  choice) stays within the plan.
* Memory checks every MEMORY_CHECK_INTERVAL decode steps (the residency
  manager sheds under pressure: streaming/residency.py).
* The plan's unused KV and prefill room lent to streamed layers while decode
  runs (streaming/lending.py): called back before a request is admitted, and
  after every step as the batch's KV grows.
* Reads beyond the plan. A process whose memory is overcommitted keeps
  re-reading its own code and weights from disk (issue 54: 130 GB read in 4.5
  minutes, no token). Every WINDOW decode steps the bytes this process read
  from storage (/proc/self/io, page faults on its files included) are compared
  with the model's bytes: past AMPLIFICATION times the model per step (and
  READ_SLACK a window; the prompt cache's own disk reads not counted), it says
  so and sheds (the pressure hooks, then resident layers) instead of going on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flashserve.engine.generation.requests import GenerationRequest, RequestHandle
from flashserve.engine.generation.stats import WorkerStats
from flashserve.engine.streaming.lending import Lending
from flashserve.engine.streaming.memory import available_memory, kv_cache_nbytes
from flashserve.engine.streaming.residency import fmt_bytes

log = logging.getLogger(__name__)

MEMORY_CHECK_INTERVAL = 64  # decode steps between memory-pressure checks
WINDOW = 8  # decode steps per read check
# A step reads at most the model once (every layer streamed); a step that reads
# twice the model re-reads what the plan meant to keep.
AMPLIFICATION = 2.0
# What a window may read besides, without a thrash: the process's code and files
# paged in once (after the page cache is dropped, a small model's first steps
# fault in more of the runtime's libraries than twice the model), and the files
# the HTTP threads serve. A thrash reads the model over and over, far past this.
READ_SLACK = 64 * 2**20


def kv_tokens(request: GenerationRequest) -> int:
    """KV tokens `request` holds at most in the batch: its prompt and whole answer, per choice."""
    return (len(request.prompt_tokens) + max(request.max_tokens, 0)) * max(request.n, 1)


def _choice_ends(request: GenerationRequest) -> list[int]:
    """Where each of the request's choices ends: its prompt and whole answer."""
    return [len(request.prompt_tokens) + max(request.max_tokens, 0)] * max(request.n, 1)


def process_read_bytes(path: Path = Path("/proc/self/io")) -> int | None:
    """Bytes this process has caused to be read from storage (Linux); None elsewhere."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemoryGuard:
    """The worker's KV budget, memory checks and read watch for one loaded model."""

    def __init__(self, loaded: Any, kv_budget: int | None, prompt_cache: Any = None) -> None:
        self.streamer = getattr(loaded, "streamer", None)
        self.kv_budget = kv_budget  # tokens; None: the plan bounds no KV
        self.prompt_cache = prompt_cache
        plan = getattr(self.streamer, "memory_plan", None)
        self.lending = (
            Lending.for_streamer(
                self.streamer,
                plan.kv_reserve_bytes // max(plan.kv_reserve_tokens, 1),
                self.streamer.max_prefetch_depth,
            )
            if kv_budget is not None
            else None
        )
        streamer = self.streamer
        # The whole model, experts included (an expert cache reads those, not the
        # layers): what one decode step reads at most with nothing resident.
        self.model_bytes = (
            streamer.non_layer_bytes
            + sum(info.dense_bytes + info.expert_bytes for info in streamer.layers)
            if streamer is not None
            else 0
        )
        self.prefill_choice: tuple[int, bool] | None = None  # for the next prefill
        self._steps = 0
        self._read_at: int | None = process_read_bytes() if self.model_bytes else None
        self._cache_read_at = self._cache_read()

    @classmethod
    def for_loaded(cls, loaded: Any, prompt_cache: Any = None, prefill: Any = None) -> MemoryGuard:
        """The guard of `loaded`; `prefill` (generation/prefill/layer_major.py's) then asks it for
        each prefill's chunk and float copies."""
        plan = getattr(getattr(loaded, "streamer", None), "memory_plan", None)
        guard = cls(loaded, getattr(plan, "kv_budget_tokens", None), prompt_cache)
        if guard.lending is not None and prefill is not None:
            prefill.settings_for = guard.take_prefill_choice
        return guard

    def take_prefill_choice(self) -> tuple[int, bool] | None:
        choice, self.prefill_choice = self.prefill_choice, None
        return choice

    def _cache_read(self) -> int:
        """Bytes the prompt cache's disk tier has read: restoring a state is no thrash."""
        disk = getattr(self.prompt_cache, "disk", None)
        return int(disk.stats.bytes_read) if disk is not None else 0

    def _queued(self) -> int:
        disk = getattr(self.prompt_cache, "disk", None)
        return disk.queued_bytes() if disk is not None else 0

    @staticmethod
    def _ends(active: dict[int, Any]) -> list[int]:
        """Where each sequence of the batch ends (`active`: the worker's choices)."""
        return [_choice_ends(c.handle.request)[0] for c in active.values()]

    def before_prefill(
        self, handles: list[RequestHandle], stats: WorkerStats, active: dict[int, Any]
    ) -> None:
        """Call the loan back for the requests about to be admitted: their prefill's
        room and their KV (restored from the prompt cache or prefilled)."""
        if self.lending is None:
            return
        lending = self.lending
        ends = [*self._ends(active), *(t for h in handles for t in _choice_ends(h.request))]
        kv = max(stats.kv_cache_bytes, lending.batch_kv_bytes(ends))
        room = lending.room(kv, self._queued(), prefill=True)
        # Through a prefill the loan keeps no more than the KV room: its peak is not
        # checked against what is free, so the runtime's reserve stays the runtime's.
        lending.settle(max(0, room - lending.runtime_bytes), grow=False)
        # What the loan does not hold is the prefill's: a larger chunk, or a layer's
        # float copies kept, where the prompts are shorter than the context.
        prompts = sum(len(h.request.prompt_tokens) for h in handles)
        self.prefill_choice = lending.prefill_settings(lending.prefill_room(room), prompts)

    def admits(self, reserved: int, request: GenerationRequest) -> bool:
        """Whether `request` may join a batch whose sequences hold `reserved` KV tokens
        (a request the batch cannot hold even alone is the server's to refuse)."""
        if self.kv_budget is None or reserved == 0:
            return True
        return reserved + kv_tokens(request) <= self.kv_budget

    def after_prefill(self, stats: WorkerStats, active: dict[int, Any], starts: list[Any]) -> None:
        """Call once the admitted requests are in the batch (`active`; `starts`: the
        worker's, for each its prompt). Where every prompt was prefilled outside the
        batch, its first step decodes: the prefill's room is the loan's again, and the
        layers that step reads stay on loan instead of being read again by the next."""
        if all(start.failed or start.logits is not None for start in starts):
            # The first step copies each prompt's cache into the batch's.
            copies = kv_cache_nbytes([s.cache for s in starts if not s.failed and s.cache])
            self._lend(stats, active, copies)

    def before_store(self, copies: int) -> None:
        """Call before ended answers' states are copied for the prompt cache (`copies`:
        their bytes, beside the batch's rows until it drops them): the loan gives back
        what they take, at once. The room counts a state only once it waits for the
        disk; until the step's end it would be the loan's and the copies' at once."""
        if self.lending is None or copies <= 0:
            return
        need = copies - (available_memory() - self.lending.keep_free)
        if need > 0:  # lent layers, freed at once (a read ahead keeps its buffer)
            streamer = self.lending.streamer
            lent = sum(streamer.layer_bytes(i) for i in streamer.lent)
            self.lending.settle(max(0, lent - need), grow=False)

    def _lend(self, stats: WorkerStats, active: dict[int, Any], copies: int = 0) -> None:
        if self.lending is None:
            return
        kv = max(stats.kv_cache_bytes, self.lending.batch_kv_bytes(self._ends(active)))
        room = self.lending.room(kv + copies, self._queued(), prefill=False)
        lent = self.lending.lent_bytes()
        if room > lent:
            # Never past what is really free: memory the plan did not foresee (the
            # Python heap, the allocator's slack) is not the loan's to hand out.
            room = min(room, lent + available_memory() - self.lending.keep_free)
        self.lending.settle(room, grow=True)

    def after_step(self, stats: WorkerStats, active: dict[int, Any]) -> None:
        """Call after each decode step (`stats`: the worker's, updated for it; `active`:
        the batch's choices)."""
        self._lend(stats, active)
        if stats.steps % MEMORY_CHECK_INTERVAL == 0 and self.streamer is not None:
            self.streamer.check_memory()
        if self._read_at is None:
            return
        self._steps += 1
        if self._steps < WINDOW:
            return
        now = process_read_bytes()
        if now is None:
            self._read_at = None
            return
        cache_read = self._cache_read()
        read = now - self._read_at - (cache_read - self._cache_read_at)
        steps = self._steps
        self._read_at, self._cache_read_at, self._steps = now, cache_read, 0
        if read <= AMPLIFICATION * self.model_bytes * steps + READ_SLACK:
            return
        per_step = read / steps
        log.warning(
            "reading %s from disk per decode step, %.1fx the model's %s: memory is "
            "overcommitted (the plan's room taken by something else); shedding",
            fmt_bytes(per_step),
            per_step / self.model_bytes,
            fmt_bytes(self.model_bytes),
        )
        if self.streamer is not None and self.streamer.residency is not None:
            self.streamer.residency.shed(per_step)
