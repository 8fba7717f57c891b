"""MoE expert offload: every SwitchGLU's experts live on SSD behind an ExpertCache.

`install_expert_offload` (experts/install.py) replaces the `switch_mlp` (mlx-lm's SwitchGLU) of
every MoE block with an `OffloadedSwitchGLU`. Routers, shared experts,
attention, norms stay where the model (or the layer-streaming plan) keeps
them. A call receives `(x, indices)` exactly like SwitchGLU.__call__ and:

1. evaluates the router's indices: one sync per MoE layer, since the ids decide
   what to read (with the next MoE layer's predicted experts when prefetch is
   on). While the router computes, the call is built ahead on every cached
   expert of the layer (compute.built_ahead): when all the ids turn out
   cached, it starts computing right after the sync, and the counting and the
   policy's bookkeeping run while it does;
2. otherwise looks every needed expert up in the cache; misses are read in
   parallel (ExpertStore, pread on a thread pool), next-layer predictions
   start reading right after them;
3. runs the original SwitchGLU code (experts/compute.py: the module is a
   template whose expert tensors are swapped in for the call) on the needed
   experts' tensors where they lie: once over a list of them on flashserve's
   kernel, else once per expert as a one-expert stack (`w[None]`, a view).
   Each token slot's arithmetic is the resident model's, so the output is
   bit-identical to it (tests check the identity). `stacked = True` instead
   copies the needed experts into one stack (kept for comparison).

When one call needs more experts than the cache holds, the experts are
processed in chunks that fit: each chunk is evaluated before the next chunk
evicts it. No expert is ever skipped. A prefill call (sequences longer than
one token) goes expert-major instead and never evicts (experts/prefill.py),
its expert rows on the integer prompt GEMM under the model's `prompt_matmul`
setting (experts/prompt_gemm.py; `prompt_xbits`, set with the model's linears).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import overload

import mlx.core as mx
import numpy as np

from flashserve.engine.experts.cache import Capacity, ExpertCache, Key, chunk_keys
from flashserve.engine.experts.compute import (
    OffloadLayer,
    built_ahead,
    compute,
    fused_glu,
    per_expert,
    restore_order,
    restore_parts,
    run_template,
    slot_sorts,
    split_rows,
)
from flashserve.engine.experts.prefetch import NextLayerPrefetch, Pending
from flashserve.engine.experts.prefill import expert_major
from flashserve.engine.experts.prompt_gemm import decode_tokens, integer_glu
from flashserve.engine.experts.stats import (
    BLOCKED_SECONDS,
    BYTES_READ,
    CALLS,
    DEMAND_BYTES,
    DEMAND_SECONDS,
    EVICTIONS,
    HITS,
    MISSES,
    PREFETCH_HITS,
    TOKENS,
    USES,
    CacheStats,
    ExpertStats,
)
from flashserve.engine.experts.store import CachedExpert, ExpertStore, ReadResult
from flashserve.engine.experts.trace import RoutingTrace

log = logging.getLogger(__name__)


class ExpertOffload:
    """The expert cache of one model: store + cache + stats + prefetch + trace."""

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        layers: dict[int, OffloadLayer],
        *,
        prefetch: bool,
        trace: RoutingTrace | None = None,
        window_tokens: int = 256,
    ) -> None:
        self.store = store
        self.cache = cache
        self.layers = layers
        self.prefetch = prefetch
        self.trace = trace
        self.order = sorted(layers)
        self.first_layer = self.order[0]
        self.nbytes = {layer: info.layout.record_bytes for layer, info in layers.items()}
        self.stats = ExpertStats(self.order, window_tokens=window_tokens)
        self.prefetcher = NextLayerPrefetch(store, cache, self.stats, self.nbytes)
        self._forward = -1
        self._token_base = 0
        self._last_tokens = 0
        self._closed = False
        self.stacked = False  # see the module doc
        self.prompt_xbits = 0  # the prefill's expert rows: prompt_matmul's bits (0: float)
        total = sum(i.layout.num_experts for i in layers.values())
        total_bytes = sum(i.layout.num_experts * i.layout.record_bytes for i in layers.values())
        self.all_fit = cache.capacity.fits(total, total_bytes)
        self._deferred: deque[tuple[int, int, int, mx.array]] = deque()
        self._ahead_rate = 1.0  # see run(): recent calls whose experts were all cached
        self.ahead_calls = 0  # decode calls that ran as built ahead (experts/compute.py)
        # Expert reads in flight during a prefill call: enough to keep every
        # I/O thread busy while the experts before them compute.
        self.prefill_window = max(2 * store.threads, 4)
        # Set by layer-major prefill (generation/prefill/layer_major.py) while it runs: MoE
        # calls go to it, so the calls of every chunk become one prefill call.
        self.gather: Callable[[int, mx.array, mx.array], mx.array] | None = None

    # -- the call -------------------------------------------------------------------

    def run(self, layer: int, x: mx.array, indices: mx.array) -> mx.array:
        if self.gather is not None:
            return self.gather(layer, x, indices)
        if indices.ndim > 2 and indices.shape[-2] > 1:
            return self.run_prefill(layer, x, indices)
        info, indices = self._enter(layer, indices)
        if info.slab is not None:
            return self._run_slab(info, x, indices)
        predicted = None
        nxt = info.next_layer
        if self.prefetch and nxt is not None and self.layers[nxt].router is not None:
            predicted = self.prefetcher.guess(self.layers[nxt], x)
        routing = [indices] if predicted is None else [indices, predicted]
        # The one sync: the router computes while the call is built ahead.
        mx.async_eval(routing)
        ahead = built_ahead(info, x, indices, self.cache) if self._ahead_rate >= 0.25 else None
        mx.eval(routing)
        ids = np.array(indices)
        keys = [(layer, int(e)) for e in np.unique(ids)]
        cached = all(key in self.cache for key in keys)
        # How often every expert was cached lately: building ahead is wasted Python otherwise.
        self._ahead_rate = 0.9 * self._ahead_rate + 0.1 * cached
        if cached and ahead is not None and ahead[1] == self.cache.version(layer):
            mx.async_eval(ahead[0])  # computes while the counting below runs
            self.ahead_calls += 1
            self._count_cached_call(info, ids, keys, predicted)
            return ahead[0]
        needed = self._account(layer, ids, self._forward, self._token_base)
        self.prefetcher.score(layer, needed)
        pending = self.prefetcher.take(layer)
        used = {e for key in keys if key not in self.cache for e in (key[1],) if e in pending}
        self.prefetcher.drop_unused(layer, pending, used)
        chunks = chunk_keys(keys, self.cache.capacity, self.nbytes)
        if len(chunks) > 1:
            return self._run_chunked(info, x, ids, chunks, pending, predicted)
        try:
            weights = self._acquire(info, keys, pending, predicted)
            out = compute(info, x, indices, ids, needed, weights, self.stacked)
            # Computes while Python builds up to the next layer's sync, which
            # waits for it anyway (so evictions there still find it done).
            mx.async_eval(out)
        finally:
            self.cache.pinned.clear()
        if self.all_fit and self._layer_complete(info):
            self._make_slab(info)
        return out

    def _count_cached_call(
        self, info: OffloadLayer, ids: np.ndarray, keys: list[Key], predicted: mx.array | None
    ) -> None:
        """The counts, trace, policy uses and prefetch of a call whose experts were all cached."""
        layer = info.layer
        needed = self._account(layer, ids, self._forward, self._token_base)
        self.prefetcher.score(layer, needed)
        self.prefetcher.drop_unused(layer, self.prefetcher.take(layer), set())
        for key in keys:
            self.cache.lookup(key)
        self.stats.add(layer, HITS, len(keys))
        if predicted is not None:
            self.prefetcher.issue(info.next_layer, predicted)

    @overload
    def run_prefill(
        self, layer: int, x: mx.array, indices: mx.array, parts: None = None
    ) -> mx.array: ...

    @overload
    def run_prefill(
        self, layer: int, x: mx.array, indices: mx.array, parts: list[int]
    ) -> list[mx.array]: ...

    def run_prefill(
        self, layer: int, x: mx.array, indices: mx.array, parts: list[int] | None = None
    ) -> mx.array | list[mx.array]:
        """A prefill call (sequences longer than one token): expert-major, each needed
        expert read once, decode's working set left in place (experts/prefill.py).

        With `parts` (token counts of consecutive runs of the call's tokens: a
        layer-major round's chunks), a list of (tokens, top-k, hidden) arrays, one
        per run, each in a block of its own (compute.restore_parts)."""
        info, indices = self._enter(layer, indices)
        k = indices.shape[-1]
        # Runs that the resident model sorts otherwise than the merged call (compute.SORT_SLOTS)
        token_sorts = slot_sorts(k, parts) if parts is not None else None
        as_decode = decode_tokens(indices.shape[-2], parts)
        x2 = x.reshape(-1, x.shape[-1])
        # On the integer GEMM a slab layer's experts go expert-major too: a row then
        # gets the same numbers whether its experts were read, cached or stacked.
        integer = integer_glu(info, x2, self.prompt_xbits, as_decode) is not None
        if info.slab is not None and not integer:
            if token_sorts is None:
                out = self._run_slab(info, x, indices)
                if parts is None:
                    return out
                return split_rows(out.reshape(-1, *out.shape[-2:]), parts)
            assert parts is not None  # token_sorts come from parts
            self._defer(info, indices)
            rows = zip(
                split_rows(x.reshape(-1, x.shape[-1]), parts),
                split_rows(indices.reshape(-1, k), parts),
                strict=True,
            )
            return [run_template(info, xp, ip, info.slab) for xp, ip in rows]
        mx.eval(indices)
        ids = np.array(indices)
        needed = self._account(layer, ids, self._forward, self._token_base, prefill=True)
        self.prefetcher.forget(layer)
        outs, positions = expert_major(
            info,
            x2,
            ids.reshape(-1, k),
            needed,
            cache=self.cache,
            store=self.store,
            stats=self.stats,
            window=self.prefill_window,
            token_sorts=token_sorts,
            xbits=self.prompt_xbits if integer else 0,
            as_decode=as_decode,
        )
        out: mx.array | list[mx.array] = (
            restore_order(outs, positions, ids.shape)
            if parts is None
            else restore_parts(outs, positions, ids.shape[-1], parts)
        )
        if self.all_fit and info.slab is None and self._layer_complete(info):
            self._make_slab(info)
        return out

    def _enter(self, layer: int, indices: mx.array) -> tuple[OffloadLayer, mx.array]:
        """What every call starts with: the layer, its routing, a new forward at layer 0."""
        indices = mx.stop_gradient(indices)
        if layer == self.first_layer:
            self._new_forward(int(indices.size // indices.shape[-1]))
        return self.layers[layer], indices

    def _new_forward(self, tokens: int) -> None:
        self._forward += 1
        self._token_base += self._last_tokens
        self._last_tokens = tokens
        self.stats.forward_started(tokens)
        # Slab layers' routing from two forwards back: computed by now (the
        # forward after it had to finish before this one's input existed), so
        # reading it costs no sync.
        while self._deferred and self._deferred[0][0] <= self._forward - 2:
            self._account_deferred(*self._deferred.popleft())

    def _account(
        self, layer: int, ids: np.ndarray, forward: int, token_base: int, prefill: bool = False
    ) -> np.ndarray:
        """Counters and trace for one call's routing; returns the sorted needed experts."""
        tokens = int(ids.size // ids.shape[-1])
        if self.trace is not None:
            self.trace.write(forward, token_base, layer, ids, prefill)
            if layer == self.order[-1]:
                self.trace.flush()
        self.stats.add_many(layer, {CALLS: 1, TOKENS: tokens, USES: int(ids.size)})
        return np.unique(ids)

    # -- fully cached layers ------------------------------------------------------------

    def _layer_complete(self, info: OffloadLayer) -> bool:
        layer = info.layer
        return all((layer, e) in self.cache for e in range(info.layout.num_experts))

    def _make_slab(self, info: OffloadLayer) -> None:
        """Restack a fully cached layer into [E, ...] tensors (once) and run it like mlx-lm.

        Only when the cache holds every expert of the model, so nothing can be
        evicted from it afterwards (memory pressure drops whole slab layers).
        The cache entries become views of the slab, so memory stays the same.
        Such a layer needs no sync and no host-side ids: its counters and trace
        lines are taken from its routing two forwards later (`_new_forward`).
        """
        layer = info.layer
        count = info.layout.num_experts
        entries = [self.cache.peek((layer, e)) for e in range(count)]
        slab = {
            spec.name: mx.stack([entry.tensors[spec.name] for entry in entries])
            for spec in info.layout.tensors
        }
        mx.eval(slab)
        for e in range(count):
            views = {name: tensor[e] for name, tensor in slab.items()}
            self.cache.replace_value((layer, e), CachedExpert(None, views))
        info.slab = slab
        log.debug("layer %d: every expert cached, running it on one stacked slab", layer)

    def _run_slab(self, info: OffloadLayer, x: mx.array, indices: mx.array) -> mx.array:
        assert info.slab is not None
        self._defer(info, indices)
        return run_template(info, x, indices, info.slab)

    def _defer(self, info: OffloadLayer, indices: mx.array) -> None:
        """A slab call's counters and trace, taken two forwards later (_new_forward)."""
        self._deferred.append((self._forward, self._token_base, info.layer, indices))

    def _account_deferred(
        self, forward: int, token_base: int, layer: int, indices: mx.array
    ) -> None:
        needed = self._account(layer, np.array(indices), forward, token_base)
        for e in needed:
            self.cache.lookup((layer, int(e)))  # keeps the policy's view of use current
        self.stats.add(layer, HITS, len(needed))

    def flush(self) -> None:
        """Count the deferred routing of slab layers now (worker thread; may sync)."""
        while self._deferred:
            self._account_deferred(*self._deferred.popleft())
        if self.trace is not None:
            self.trace.flush()

    def _dissolve_slabs(self) -> int:
        """Drop every slab layer's experts and built-ahead lists (memory pressure);
        returns bytes freed."""
        freed = 0
        for info in self.layers.values():
            info.every = None  # its lists would keep evicted experts' buffers alive
            if info.slab is None:
                continue
            info.slab = None
            for e in range(info.layout.num_experts):
                key = (info.layer, e)
                if key in self.cache:
                    self.cache.evict(key)
                    self.stats.resident(info.layer, -1, -self.nbytes[info.layer])
                    self.stats.add(info.layer, EVICTIONS)
                    freed += self.nbytes[info.layer]
        return freed

    def _acquire(
        self,
        info: OffloadLayer,
        keys: list[Key],
        pending: dict[int, Pending],
        predicted: mx.array | None,
    ) -> dict[int, dict[str, mx.array]]:
        """Make `keys` resident and pinned; return expert -> tensors. Issues the prefetch."""
        layer = info.layer
        cache = self.cache
        cache.pinned.update(k for k in keys if k in cache)
        missing = [k for k in keys if k not in cache and k[1] not in pending]
        demand_start = time.perf_counter()
        futures: dict[int, Future[ReadResult]] = {}
        if missing:
            for key, fut in zip(missing, self.store.submit_many(missing), strict=True):
                futures[key[1]] = fut
        if predicted is not None:
            self.prefetcher.issue(info.next_layer, predicted)

        weights: dict[int, dict[str, mx.array]] = {}
        counts = {HITS: 0, PREFETCH_HITS: 0, MISSES: 0, EVICTIONS: 0, BLOCKED_SECONDS: 0.0}
        fresh: list[tuple[Key, CachedExpert, int]] = []
        try:
            for key in keys:
                value = cache.lookup(key)
                if value is not None:
                    counts[HITS] += 1
                    weights[key[1]] = value.tensors
                    continue
                if key[1] in futures:
                    fut = futures[key[1]]
                    counts[MISSES] += 1
                else:
                    fut = pending[key[1]].future
                    self.prefetcher.landed(pending[key[1]])
                    counts[PREFETCH_HITS] += 1
                waited = time.perf_counter()
                result = fut.result()  # ExpertReadError names the layer and expert
                counts[BLOCKED_SECONDS] += time.perf_counter() - waited
                tensors = self.store.tensors(layer, result.record)
                weights[key[1]] = tensors
                fresh.append((key, CachedExpert(result.buffer, tensors), result.nbytes))
        except BaseException:
            for fut in futures.values():
                fut.cancel()
            raise
        if missing:
            demand_bytes = sum(self.nbytes[layer] for _ in missing)
            self.stats.add_many(
                layer,
                {
                    DEMAND_BYTES: demand_bytes,
                    BYTES_READ: demand_bytes,
                    DEMAND_SECONDS: time.perf_counter() - demand_start,
                },
            )
        if fresh:
            mx.eval([c.tensors for _, c, _ in fresh])  # views of the read buffers: no copy
            # Inserted in key order so the policy sees the same access order as a
            # trace replay does.
            for key, cached, nbytes in fresh:
                self._insert(key, cached, nbytes, counts)
        self.stats.add_many(layer, counts)
        return weights

    def _insert(self, key: Key, cached: CachedExpert, nbytes: int, counts: dict) -> None:
        evicted = self.cache.insert(key, cached, nbytes)
        self.cache.pinned.add(key)
        self.stats.resident(key[0], 1, nbytes)
        for old in evicted:
            self.stats.resident(old[0], -1, -self.nbytes[old[0]])
            if old[0] == key[0]:
                counts[EVICTIONS] += 1
            else:
                self.stats.add(old[0], EVICTIONS)

    # -- compute --------------------------------------------------------------------

    def _run_chunked(
        self,
        info: OffloadLayer,
        x: mx.array,
        ids: np.ndarray,
        chunks: list[list[Key]],
        pending: dict[int, Pending],
        predicted: mx.array | None,
    ) -> mx.array:
        k = ids.shape[-1]
        flat = ids.reshape(-1, k)
        x2 = x.reshape(-1, x.shape[-1])
        outs, positions = [], []
        fused = fused_glu(info, x2)
        for i, chunk in enumerate(chunks):
            experts = np.array([e for _, e in chunk])
            try:
                weights = self._acquire(info, chunk, pending, predicted if i == 0 else None)
                chunk_outs, chunk_positions = per_expert(info, x2, flat, experts, weights, fused)
                # Evaluate before the next chunk evicts these experts, so memory
                # stays within the cache capacity.
                mx.eval(chunk_outs)
            finally:
                self.cache.pinned.clear()
            outs.extend(chunk_outs)
            positions.extend(chunk_positions)
        return restore_order(outs, positions, ids.shape)

    # -- reporting --------------------------------------------------------------------

    def snapshot(self) -> CacheStats:
        total, gtotal, window, gwindow, resident = self.stats.copy()
        cap = self.cache.capacity
        occ_slots = int(resident[:, 0].sum())
        occ_bytes = int(resident[:, 1].sum())
        return CacheStats(
            policy=self.cache.policy.name,
            prefetch="next-layer" if self.prefetch else "none",
            capacity_slots=cap.slots,
            capacity_bytes=cap.nbytes,
            occupancy_slots=occ_slots,
            occupancy_bytes=occ_bytes,
            occupancy_fraction=cap.used(occ_slots, occ_bytes),
            total_experts=sum(i.layout.num_experts for i in self.layers.values()),
            expert_bytes=max(self.nbytes.values()),
            moe_layers=list(self.order),
            io_threads=self.store.threads,
            window_tokens=self.stats.window_tokens,
            uptime_s=self.stats.uptime(),
            since_start=self.stats.view(total, gtotal, resident),
            window=self.stats.view(window, gwindow, resident),
            last_step=self.stats.step_view(),
        )

    def reset_window(self) -> None:
        self.stats.reset_window()

    def reset(self, clear_cache: bool = False) -> None:
        """Zero the counters (bench); optionally empty the cache. Worker thread only."""
        self.flush()  # deferred routing still belongs in the trace (its counts are zeroed next)
        if clear_cache:
            for info in self.layers.values():
                info.slab = None
            self.cache.clear()
            self.cache.pinned.clear()
            self.stats.clear_resident()
            self.prefetcher.clear()
        self.stats.reset()

    def preload(self) -> int:
        """Read experts, layer by layer in id order, until the cache is full.

        A warm start (and the bench's "every expert cached" row). Not counted
        in the hit / miss statistics. Worker thread only; returns experts read.
        """
        todo: list[Key] = []
        slots, size = len(self.cache), self.cache.nbytes
        for layer in self.order:
            for e in range(self.layers[layer].layout.num_experts):
                key = (layer, e)
                if key in self.cache:
                    continue
                if not self.cache.capacity.fits(slots + 1, size + self.nbytes[layer]):
                    break
                todo.append(key)
                slots, size = slots + 1, size + self.nbytes[layer]
        batch = 4 * self.store.threads
        for i in range(0, len(todo), batch):
            keys = todo[i : i + batch]
            results = [f.result() for f in self.store.submit_many(keys)]
            for key, result in zip(keys, results, strict=True):
                tensors = self.store.tensors(key[0], result.record)
                mx.eval(tensors)
                self.cache.insert(key, CachedExpert(result.buffer, tensors), result.nbytes)
                self.stats.resident(key[0], 1, result.nbytes)
        if self.all_fit:
            for info in self.layers.values():
                if info.slab is None and self._layer_complete(info):
                    self._make_slab(info)
        return len(todo)

    def shrink(self, deficit: int) -> int:
        """Memory-pressure hook (ResidencyManager): give back about `deficit` bytes.

        Lowers the capacity (never under one layer's top-k) and evicts down to
        it. Runs on the worker thread between tokens, when nothing is pinned.
        Layers running on a slab (every expert cached) are dropped whole: their
        experts share one buffer, so evicting a few would free nothing.
        """
        cap = self.cache.capacity
        floor_slots = max(i.top_k for i in self.layers.values())
        per = max(self.nbytes.values())
        want_bytes = max(self.cache.nbytes - int(deficit), floor_slots * per)
        if cap.slots is not None:
            new = Capacity(slots=max(floor_slots, min(cap.slots, want_bytes // per)))
        else:
            new = Capacity(nbytes=max(floor_slots * per, min(cap.nbytes or 0, want_bytes)))
        before = self.cache.nbytes
        self.cache.capacity = new
        self.all_fit = False
        self._deferred.clear()
        self._dissolve_slabs()
        while len(self.cache) and not new.fits(len(self.cache), self.cache.nbytes):
            victim = self.cache.policy.victim(set())
            if victim is None:
                break
            self.cache.evict(victim)
            self.stats.resident(victim[0], -1, -self.nbytes[victim[0]])
            self.stats.add(victim[0], EVICTIONS)
        freed = before - self.cache.nbytes
        self.store.drop_free()
        if freed:
            mx.clear_cache()
            log.warning(
                "memory pressure: expert cache shrunk to %s, freed %.1f MB",
                new.describe(),
                freed / 1e6,
            )
        return freed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.trace is not None:
            self.trace.close()
        self.store.close()
