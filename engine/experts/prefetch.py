"""Next-layer expert prefetch: read the experts the next MoE layer will likely use
while this one runs (the `expert_prefetch` setting, `next-layer`).

The guess is the next layer's router applied to this layer's input: the hidden
state changes little from one layer to the next. A guessed expert that is not
cached is read at once on the store's pool; the next layer's call takes the
reads it needs and drops the rest (wasted bytes, counted).

Its buffers come out of the expert cache's capacity: before a guess is read,
the cache evicts that many bytes (`ExpertCache.prefetching` keeps them free
until the read is taken or dropped). So prefetch never holds memory beside the
cache, which the memory plan needs: with its reads beside the cache, decode's
peak private memory rose 91 MB under the cap bench's plan and the server was
OOM-killed.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from flashserve.engine.experts.cache import ExpertCache
from flashserve.engine.experts.compute import OffloadLayer
from flashserve.engine.experts.stats import (
    BYTES_READ,
    EVICTIONS,
    PREDICTED,
    PREDICTED_ACTUAL,
    PREDICTED_CORRECT,
    PREFETCH_BYTES,
    PREFETCH_READS,
    PREFETCH_WASTED,
    PREFETCH_WASTED_BYTES,
    ExpertStats,
)
from flashserve.engine.experts.store import ExpertStore, ReadResult


@dataclass
class Pending:
    future: Future[ReadResult]
    nbytes: int


class NextLayerPrefetch:
    """The guesses and the reads in flight of one model's offload."""

    def __init__(
        self, store: ExpertStore, cache: ExpertCache, stats: ExpertStats, nbytes: dict[int, int]
    ) -> None:
        self.store = store
        self.cache = cache
        self.stats = stats
        self.nbytes = nbytes
        self._pending: dict[int, dict[int, Pending]] = {}
        self._predicted: dict[int, set[int]] = {}

    @staticmethod
    def guess(nxt: OffloadLayer, x: mx.array) -> mx.array:
        """The next layer's top-k for `x` (lazy)."""
        assert nxt.router is not None
        out = nxt.router(x)
        if isinstance(out, tuple):  # routers that return (indices, scores)
            return out[0]
        k = nxt.top_k
        return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]

    def issue(self, layer: int | None, predicted: mx.array) -> None:
        """Start reading `layer`'s guessed experts that are neither cached nor on their way."""
        if layer is None:
            return
        guess = {int(e) for e in np.unique(np.array(predicted))}
        self._predicted[layer] = guess
        pending = self._pending.setdefault(layer, {})
        todo = [
            (layer, e) for e in sorted(guess) if (layer, e) not in self.cache and e not in pending
        ]
        size = self.nbytes[layer]
        todo = todo[: self._reserve(layer, len(todo) * size) // size]
        if not todo:
            return
        for key, fut in zip(todo, self.store.submit_many(todo), strict=True):
            pending[key[1]] = Pending(fut, size)
        total = len(todo) * size
        self.stats.add_many(
            layer, {PREFETCH_READS: len(todo), PREFETCH_BYTES: total, BYTES_READ: total}
        )

    def _reserve(self, layer: int, nbytes: int) -> int:
        """Evict (unpinned) experts until `nbytes` more fit beside the cache's entries;
        returns the bytes reserved (less when pinned experts fill the rest)."""
        cache = self.cache
        for old in cache.make_room(nbytes):
            self.stats.resident(old[0], -1, -self.nbytes[old[0]])
            self.stats.add(old[0], EVICTIONS)
        free = cache.free_bytes()
        got = nbytes if free is None else max(0, min(nbytes, free))
        cache.prefetching += got
        return got

    def take(self, layer: int) -> dict[int, Pending]:
        """`layer`'s reads in flight, handed to its call (which takes or drops each)."""
        return self._pending.pop(layer, {})

    def landed(self, item: Pending) -> None:
        """A read the call takes: its bytes go back to the cache, which inserts it."""
        self.cache.prefetching -= item.nbytes

    def drop_unused(self, layer: int, pending: dict[int, Pending], used: set[int]) -> None:
        """Cancel or count as wasted the reads the call did not use."""
        wasted = 0
        wasted_bytes = 0
        for expert, item in pending.items():
            if expert in used:
                continue
            self.cache.prefetching -= item.nbytes
            if item.future.cancel():  # never started: no bytes were read
                self.stats.add_many(
                    layer,
                    {PREFETCH_READS: -1, PREFETCH_BYTES: -item.nbytes, BYTES_READ: -item.nbytes},
                )
                continue
            wasted += 1
            wasted_bytes += item.nbytes
        if wasted:
            self.stats.add_many(
                layer, {PREFETCH_WASTED: wasted, PREFETCH_WASTED_BYTES: wasted_bytes}
            )

    def score(self, layer: int, needed: np.ndarray) -> None:
        """Count how good the guess for `layer` was."""
        guess = self._predicted.pop(layer, None)
        if guess is None:
            return
        actual = {int(e) for e in needed}
        self.stats.add_many(
            layer,
            {
                PREDICTED: len(guess),
                PREDICTED_CORRECT: len(guess & actual),
                PREDICTED_ACTUAL: len(actual),
            },
        )

    def forget(self, layer: int) -> None:
        """A prefill call: no guess to score, no read to take."""
        self._predicted.pop(layer, None)
        self.drop_unused(layer, self.take(layer), set())

    def clear(self) -> None:
        for layer in list(self._pending):
            for item in self.take(layer).values():
                item.future.cancel()
                self.cache.prefetching -= item.nbytes
        self._predicted.clear()
