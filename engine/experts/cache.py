"""The expert cache: which (layer, expert) weight sets stay in memory.

One global pool for all MoE layers, sized in slots (experts) or bytes. A global
pool rather than a fixed share per layer because routing skew differs a lot
between layers: a layer whose router concentrates on a few experts needs few
slots, a layer with flat routing would waste a per-layer quota, and a byte
budget (`--expert-cache 3GB`) maps onto one pool without guessing a split.
The cost of a global pool — one hot layer could starve the others — is what
the eviction policy is for.

Eviction policies are pluggable (`Policy`). LRU is the default; `LFUDecay` is
the frequency-aware one: it keeps an exponentially decayed use count for every
expert it has seen (also evicted ones, so a popular expert that was pushed out
comes back with its history) and evicts the resident expert with the lowest
count. `Belady` (needs the future) exists for trace replay only.

The cache is driven by one thread (the worker); nothing here locks.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Key = tuple[int, int]  # (layer, expert)

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "T": 1e12, "TB": 1e12})


class CacheCapacityError(ValueError):
    """A capacity that cannot work (unparseable, or smaller than one layer's top-k)."""


@dataclass(frozen=True)
class Capacity:
    """Either a number of expert slots or a number of bytes."""

    slots: int | None = None
    nbytes: int | None = None

    @staticmethod
    def parse(spec: str | int) -> Capacity:
        """'2048' -> 2048 slots; '3GB' / '512MiB' / '1.5G' -> bytes."""
        if isinstance(spec, int):
            return Capacity(slots=spec)
        text = str(spec).strip().upper().replace(" ", "")
        if text.isdigit():
            return Capacity(slots=int(text))
        number = text.rstrip("KMGTIB")
        unit = text[len(number) :]
        if unit not in _UNITS or unit == "":
            raise CacheCapacityError(
                f"expert cache size {spec!r}: expected a slot count (2048) or bytes (3GB, 512MiB)"
            )
        try:
            value = float(number)
        except ValueError:
            raise CacheCapacityError(
                f"expert cache size {spec!r}: expected a slot count (2048) or bytes (3GB, 512MiB)"
            ) from None
        return Capacity(nbytes=int(value * _UNITS[unit]))

    def fits(self, slots: int, nbytes: int) -> bool:
        if self.slots is not None:
            return slots <= self.slots
        assert self.nbytes is not None
        return nbytes <= self.nbytes

    def used(self, slots: int, nbytes: int) -> float:
        """The fraction that `slots` experts of `nbytes` in all fill (0 for no capacity)."""
        if self.slots is not None:
            return slots / self.slots if self.slots else 0.0
        return nbytes / self.nbytes if self.nbytes else 0.0

    def describe(self) -> str:
        if self.slots is not None:
            return f"{self.slots} slots"
        return fmt_bytes(self.nbytes or 0)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class Policy(Protocol):
    """What the cache tells a policy, in access order, and what it asks."""

    name: str

    def access(self, key: Key) -> None:
        """`key` was used (a hit, or a miss just inserted). Called once per use."""

    def insert(self, key: Key) -> None:
        """`key` became resident (always preceded by its `access`)."""

    def remove(self, key: Key) -> None:
        """`key` is no longer resident."""

    def victim(self, pinned: set[Key]) -> Key | None:
        """The resident key to evict next, never one in `pinned`; None if none."""


class LRU:
    """Least recently used."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def access(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def insert(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: set[Key]) -> Key | None:
        for key in self._order:  # oldest first; pinned ones are the newest, so this is short
            if key not in pinned:
                return key
        return None


class LFUDecay:
    """Least frequently used, with exponentially decaying counts.

    score(key, t) = sum over uses u of 2^-((t - t_u) / half_life), t counted in
    accesses. Since every score decays by the same factor, the order of two
    scores never changes between their updates, so the time-free log-score
    log2(count_at_last_use) + t_last / half_life ranks resident keys in a heap
    (lazy deletion) and a victim costs O(log n). Ties go to the older use.
    """

    name = "lfu"

    def __init__(self, half_life: float = 4096.0) -> None:
        self.half_life = float(half_life)
        self._t = 0
        self._count: dict[Key, tuple[float, int]] = {}  # key -> (count at t_last, t_last)
        self._rank: dict[Key, float] = {}  # resident key -> current heap rank
        self._heap: list[tuple[float, int, Key]] = []

    def _log_score(self, key: Key) -> float:
        count, last = self._count[key]
        return math.log2(count) + last / self.half_life

    def access(self, key: Key) -> None:
        self._t += 1
        count, last = self._count.get(key, (0.0, self._t))
        count = count * 2.0 ** (-(self._t - last) / self.half_life) + 1.0
        self._count[key] = (count, self._t)
        if key in self._rank:
            self._push(key)
        if len(self._count) > 4 * max(len(self._rank), 1024):
            self._forget()

    def insert(self, key: Key) -> None:
        if key not in self._count:  # inserted without a use (trace replay of a warm cache)
            self._count[key] = (1.0, self._t)
        self._push(key)

    def _push(self, key: Key) -> None:
        rank = self._log_score(key)
        self._rank[key] = rank
        heapq.heappush(self._heap, (rank, self._count[key][1], key))
        if len(self._heap) > 4 * len(self._rank) + 64:  # drop stale heap entries
            self._heap = [(r, t, k) for r, t, k in self._heap if self._rank.get(k) == r]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._rank.pop(key, None)

    def victim(self, pinned: set[Key]) -> Key | None:
        skipped = []
        found = None
        while self._heap:
            rank, t, key = heapq.heappop(self._heap)
            if self._rank.get(key) != rank:
                continue  # stale entry
            if key in pinned:
                skipped.append((rank, t, key))
                continue
            found = key
            skipped.append((rank, t, key))  # stays until remove() makes it stale
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def _forget(self) -> None:
        """Bound the history: drop non-resident keys whose count decayed below 1/16."""
        horizon = 4 * self.half_life
        self._count = {
            k: v for k, v in self._count.items() if k in self._rank or self._t - v[1] < horizon
        }


class Belady:
    """Evict the resident key used again furthest in the future (optimal; replay only).

    Built from the accesses the cache will see, as a list of steps (one
    step: the keys one layer call needs, each at most once). The order of
    accesses inside a step does not matter: each key has its own pointer into
    the list of steps that use it.
    """

    name = "belady"

    def __init__(self, steps: Sequence[Sequence[Key]]) -> None:
        self._uses: dict[Key, list[int]] = {}
        for i, step in enumerate(steps):
            for key in step:
                self._uses.setdefault(key, []).append(i)
        self._never = len(steps) + 1
        self._seen: dict[Key, int] = {}  # key -> accesses so far
        self._next_use: dict[Key, int] = {}  # resident key -> step of its next use
        self._heap: list[tuple[int, Key]] = []  # (-next use, key), lazy

    def _upcoming(self, key: Key) -> int:
        uses = self._uses.get(key, [])
        n = self._seen.get(key, 0)
        return uses[n] if n < len(uses) else self._never

    def access(self, key: Key) -> None:
        self._seen[key] = self._seen.get(key, 0) + 1
        if key in self._next_use:
            self._set(key)

    def insert(self, key: Key) -> None:
        self._set(key)

    def _set(self, key: Key) -> None:
        nxt = self._upcoming(key)
        self._next_use[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))

    def remove(self, key: Key) -> None:
        self._next_use.pop(key, None)

    def victim(self, pinned: set[Key]) -> Key | None:
        skipped = []
        found = None
        while self._heap:
            neg, key = heapq.heappop(self._heap)
            if self._next_use.get(key) != -neg:
                continue
            skipped.append((neg, key))
            if key not in pinned:
                found = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found


POLICIES = ("lru", "lfu")
# Tuned on recorded traces (docs/benchmarks/expert-cache.md): 2-8 tokens do about as well.
LFU_HALF_LIFE_TOKENS = 4.0


def make_policy(name: str, accesses_per_token: int | None = None) -> Policy:
    """A fresh policy by name. `accesses_per_token` (sum of top-k over MoE layers)
    sets LFU's half-life to LFU_HALF_LIFE_TOKENS decoded tokens."""
    if name == "lru":
        return LRU()
    if name == "lfu":
        if accesses_per_token:
            return LFUDecay(half_life=LFU_HALF_LIFE_TOKENS * accesses_per_token)
        return LFUDecay()
    raise CacheCapacityError(
        f"unknown expert cache policy {name!r}: choose one of {', '.join(POLICIES)}"
    )


@dataclass
class Entry:
    value: Any
    nbytes: int


class ExpertCache:
    """A bounded map (layer, expert) -> value with a pluggable eviction policy.

    `pin` marks keys that the current layer call needs: they are never evicted
    while pinned, so a layer's experts stay put while its weights are stacked.
    """

    def __init__(
        self,
        capacity: Capacity,
        policy: Policy | str = "lru",
        on_evict: Callable[[Key, Any], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.on_evict = on_evict
        self._entries: dict[Key, Entry] = {}
        self.nbytes = 0
        self.pinned: set[Key] = set()
        # The memory plan's prefill room (streaming/memplan.py): bytes of the
        # capacity a prefill borrows for its activations, and what is held now
        # (experts/prefill.py hold_room); inserts keep `held` bytes free.
        self.prefill_room = 0
        self.chunk_activation_bytes = 0  # of the room: one prefill chunk's activations
        self.state_bytes_per_token = 0  # KV (or state) per token: a hit's copies
        self.held = 0
        self.prefetching = 0  # bytes of prefetched records in flight (experts/prefetch.py)
        # layer -> changes to its keys or values: lists built over a layer's
        # cached experts (experts/compute.py: built_ahead) are current while it stands.
        self._versions: dict[int, int] = {}

    def version(self, layer: int) -> int:
        """A number that changes whenever one of `layer`'s entries is added, evicted or replaced."""
        return self._versions.get(layer, 0)

    def _changed(self, key: Key) -> None:
        self._versions[key[0]] = self._versions.get(key[0], 0) + 1

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def keys(self) -> Iterable[Key]:
        return self._entries.keys()

    def __iter__(self) -> Iterator[Key]:
        return iter(self._entries)

    def lookup(self, key: Key) -> Any | None:
        """The value on a hit (counted as a use), None on a miss (not counted yet)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self.policy.access(key)
        return entry.value

    def peek(self, key: Key) -> Any | None:
        """The value, without counting a use."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def replace_value(self, key: Key, value: Any) -> None:
        """Swap a resident key's value (same size), without counting a use."""
        self._entries[key].value = value
        self._changed(key)

    def room_for(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` could be inserted after evicting unpinned keys."""
        pinned_bytes = sum(self._entries[k].nbytes for k in self.pinned if k in self._entries)
        pinned_slots = sum(1 for k in self.pinned if k in self._entries)
        return self.capacity.fits(pinned_slots + 1, pinned_bytes + nbytes + self.reserved)

    def insert(self, key: Key, value: Any, nbytes: int) -> list[Key]:
        """Insert a missed key (counted as a use); return the keys evicted for it."""
        self.policy.access(key)
        evicted = self.make_room(nbytes, slots=1)
        if self._entries and not self.capacity.fits(
            len(self._entries) + 1, self.nbytes + nbytes + self.reserved
        ):
            raise CacheCapacityError(
                f"expert cache ({self.capacity.describe()}) is full of experts the "
                "current layer needs"
            )
        self._entries[key] = Entry(value, nbytes)
        self._changed(key)
        self.nbytes += nbytes
        self.policy.insert(key)
        return evicted

    def has_room(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` fits now, without evicting anything."""
        return self.capacity.fits(len(self._entries) + 1, self.nbytes + nbytes + self.reserved)

    @property
    def reserved(self) -> int:
        """Capacity kept free of entries: a prefill's room and prefetches in flight."""
        return self.held + self.prefetching

    def make_room(self, nbytes: int, slots: int = 0) -> list[Key]:
        """Evict unpinned keys until `slots` more entries of `nbytes` in all fit beside
        the entries and what is reserved; returns the keys evicted (fewer when the
        rest is pinned)."""
        evicted = []
        while self._entries and not self.capacity.fits(
            len(self._entries) + slots, self.nbytes + self.reserved + nbytes
        ):
            victim = self.policy.victim(self.pinned)
            if victim is None:
                break
            self._evict(victim)
            evicted.append(victim)
        return evicted

    def free_bytes(self) -> int | None:
        """Bytes of the capacity neither cached nor held; None for a slot count."""
        if self.capacity.nbytes is None:
            return None
        return self.capacity.nbytes - self.nbytes - self.reserved

    def _evict(self, key: Key) -> None:
        entry = self._entries.pop(key)
        self._changed(key)
        self.nbytes -= entry.nbytes
        self.policy.remove(key)
        if self.on_evict is not None:
            self.on_evict(key, entry.value)

    def evict(self, key: Key) -> None:
        """Drop `key` now (memory pressure); it must not be pinned."""
        self._evict(key)

    def clear(self) -> None:
        for key in list(self._entries):
            self._evict(key)


def chunk_keys(keys: list[Key], capacity: Capacity, nbytes: dict[int, int]) -> list[list[Key]]:
    """Split one call's needed keys (sorted) into runs that each fit the cache."""
    chunks: list[list[Key]] = [[]]
    size = 0
    for key in keys:
        b = nbytes[key[0]]
        if chunks[-1] and not capacity.fits(len(chunks[-1]) + 1, size + b):
            chunks.append([])
            size = 0
        chunks[-1].append(key)
        size += b
    return [c for c in chunks if c]
