"""Replay a routing trace through cache policies: LRU, LFU with decay, Belady.

A trace (`--record-routing FILE`) has one JSON line per token and MoE layer:
{"fwd": forward pass, "token": position, "layer": l, "experts": [ids]}. One
forward through one layer is one cache access group: the union of its tokens'
experts (a prompt's prefill is one group per layer, a decoded token is one).

The replay drives the same ExpertCache and the same chunking as the live
offload (expert_offload.chunk_keys), in the same access order (sorted ids per
group), so its LRU / LFU numbers are what the server would see for that
routing at that capacity. Belady evicts the expert used again furthest in the
future: no policy that does not know the future can beat it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from flashserve.engine.experts.cache import (
    Belady,
    Capacity,
    ExpertCache,
    Key,
    Policy,
    chunk_keys,
    make_policy,
)


class AccessGroup(list):
    """The sorted keys one layer call needs; `prefill` for a prompt's call."""

    prefill: bool = False


def load_trace(path: str | Path) -> list[list[Key]]:
    """Access groups of a JSONL routing trace, in order; each a sorted key list
    (an AccessGroup: it says whether the call was a prefill)."""
    groups: list[list[Key]] = []
    current: tuple[int, int] | None = None
    members: set[int] = set()
    prefill = False

    def close() -> None:
        if current is not None:
            group = AccessGroup((current[1], e) for e in sorted(members))
            group.prefill = prefill
            groups.append(group)

    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            ident = (int(rec["fwd"]), int(rec["layer"]))
            if ident != current:
                close()
                current, members = ident, set()
                prefill = bool(rec.get("prefill"))
            members.update(int(e) for e in rec["experts"])
    close()
    return groups


def access_sequence(groups: Iterable[list[Key]], capacity: Capacity) -> list[list[Key]]:
    """Groups split into the chunks the live cache processes one at a time
    (a prefill group stays whole: it never evicts, so it needs no chunks)."""
    out = []
    for group in groups:
        if getattr(group, "prefill", False):
            out.append(group)
            continue
        layers = {k[0] for k in group}
        chunk = chunk_keys(group, capacity, dict.fromkeys(layers, 1))
        for keys in chunk:
            out.append(AccessGroup(keys))
    return out


def accesses_per_token_of(groups: list[list[Key]]) -> int:
    """Expert uses of one decoded token: the sum over layers of the smallest group size
    (a one-token call uses exactly top-k experts)."""
    smallest: dict[int, int] = {}
    for group in groups:
        if group:
            layer = group[0][0]
            smallest[layer] = min(smallest.get(layer, len(group)), len(group))
    return sum(smallest.values())


def routing_skew(groups: list[list[Key]], top_k: int) -> tuple[float, float]:
    """(distinct experts a layer used, share of uses its top-k experts took), averaged
    over layers, counting one-token calls (decode) only: how concentrated routing is."""
    from collections import Counter

    counts: dict[int, Counter] = {}
    for group in groups:
        if len(group) == top_k:
            counts.setdefault(group[0][0], Counter()).update(e for _, e in group)
    if not counts:
        return 0.0, 0.0
    distinct = sum(len(c) for c in counts.values()) / len(counts)
    share = sum(
        sum(n for _, n in c.most_common(top_k)) / sum(c.values()) for c in counts.values()
    ) / len(counts)
    return distinct, share


@dataclass
class ReplayResult:
    policy: str
    capacity: int  # slots
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def replay(
    groups: list[list[Key]],
    slots: int,
    policy: str | Policy,
    accesses_per_token: int | None = None,
) -> ReplayResult:
    """Hits and misses of `groups` through a cache of `slots` experts.

    `accesses_per_token` (the sum of top-k over MoE layers) gives "lfu" the
    half-life the live cache uses; by default it is read off the trace.
    """
    capacity = Capacity(slots=slots)
    chunks = access_sequence(groups, capacity)
    if policy == "belady":
        policy = Belady(chunks)
    elif isinstance(policy, str):
        policy = make_policy(policy, accesses_per_token or accesses_per_token_of(groups))
    cache = ExpertCache(capacity, policy)
    hits = misses = 0
    for chunk in chunks:
        if getattr(chunk, "prefill", False):
            # experts/prefill.py: hits are not counted as uses, misses enter
            # only while there is free room, in id order.
            missed = [k for k in chunk if k not in cache]
            hits += len(chunk) - len(missed)
            misses += len(missed)
            belady = isinstance(cache.policy, Belady)  # its future pointers count every use
            for key in chunk:
                if key not in missed or not capacity.fits(len(cache) + 1, cache.nbytes + 1):
                    if belady:
                        cache.policy.access(key)
                else:
                    cache.insert(key, True, 1)  # counts the use itself
            continue
        # Same order as the live offload: pin what is resident, look the hits
        # up, then insert the misses, each in sorted order.
        cache.pinned.update(k for k in chunk if k in cache)
        missed = [k for k in chunk if cache.lookup(k) is None]
        hits += len(chunk) - len(missed)
        misses += len(missed)
        for key in missed:
            cache.insert(key, True, 1)
            cache.pinned.add(key)
        cache.pinned.clear()
    return ReplayResult(cache.policy.name, slots, hits, misses)


def replay_table(
    groups: list[list[Key]],
    capacities: list[int],
    policies: tuple[str, ...] = ("lru", "lfu", "belady"),
    accesses_per_token: int | None = None,
) -> list[ReplayResult]:
    return [replay(groups, c, p, accesses_per_token) for c in capacities for p in policies]
