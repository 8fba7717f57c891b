"""Expert-major prefill: one MoE call over a prompt's tokens reads each needed expert once.

A prefill call routes its tokens to nearly every expert of the layer, far
more than a decode step needs, and usually more than the expert cache holds.
Going through the cache (experts/offload.py's decode path) would evict
decode's working set for experts that the prompt uses once. So a prefill call
(sequences longer than one token; generation/prefill/layer_major.py makes it one call for
every chunk of the prompts being prefilled) runs expert by expert instead:

* cached experts are used where they are, without counting a use, so the
  policy's view of decode's working set stays as it was;
* missing experts are read in id order (their records lie in id order on
  disk) with `window` reads in flight, each run on all of its tokens as soon
  as its read lands; its output is computing while the next one is built,
  and its buffer is then either kept in the cache, if the cache has free
  room (a cold start fills up; nothing is ever evicted for a prefill), or
  recycled for the next read;
* where the template is mlx-lm's plain SwitchGLU on flashserve's kernel, an
  expert is one op (compute.fused_glu: its rows read in place, gate and up
  in one pass, each part on every core), on one stream;
* under the `prompt_matmul` setting "int16" or "int8" an expert is instead
  its gate and up projections as one call of the integer prompt GEMM, the
  activation, and the down projection as another (prompt_gemm.py): a
  decode-kernel row costs a decode step's, a GEMM row a small share of it;
* otherwise, with two cores or more, experts run two at a time, each on its
  own MLX stream (compute.expert_streams): a landed read is paired with the
  next one if that has landed too, and cached experts alternate. Each
  expert's small ops between its matmuls (gathers, SwiGLU, copies), which
  the kernel's pool does not split, then run beside the other expert's work
  (issue 46: the prefill's critical path was its stream thread).

Memory: `window` records in flight plus the call's outputs (tokens x top-k
rows). In float the arithmetic is the decode path's (experts/compute.py, one
expert at a time), so the output is the same bit for bit; on the integer GEMM
a row's numbers are its own, whatever else the call holds.

Under the memory plan (streaming/memplan.py) the cache also lends a prefill
the room its activations take: `hold_room` evicts experts before the prefill
starts and keeps that room free until `release_room`, after which decode
misses fill the cache again.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import mlx.core as mx
import numpy as np

from flashserve.engine.compute import heap
from flashserve.engine.experts.cache import ExpertCache
from flashserve.engine.experts.compute import OffloadLayer, expert_streams, fused_glu, per_expert
from flashserve.engine.experts.prompt_gemm import integer_glu
from flashserve.engine.experts.stats import (
    BLOCKED_SECONDS,
    BYTES_READ,
    DEMAND_BYTES,
    DEMAND_SECONDS,
    EVICTIONS,
    HITS,
    MISSES,
    ExpertStats,
)
from flashserve.engine.experts.store import CachedExpert, ExpertStore, ReadResult


def expert_major(
    info: OffloadLayer,
    x2: mx.array,
    flat: np.ndarray,
    needed: np.ndarray,
    *,
    cache: ExpertCache,
    store: ExpertStore,
    stats: ExpertStats,
    window: int,
    token_sorts: np.ndarray | None = None,
    xbits: int = 0,
    as_decode: np.ndarray | bool = False,
) -> tuple[list[mx.array], list[np.ndarray]]:
    """Run every needed expert of one prefill call once; see the module doc.

    `x2` is (tokens, hidden), `flat` the routing (tokens, top-k) on the host,
    `token_sorts` compute.slot_sorts' for a call merged from several;
    `xbits` the `prompt_matmul` setting's bits for the expert rows (0: float) and
    `as_decode` the tokens that run as decode all the same (prompt_gemm.py).
    Returns the per-expert outputs and their token-slot positions
    (experts/compute.py: `restore_order` puts them back in order).
    """
    layer = info.layer
    nbytes = info.layout.record_bytes
    cached = [int(e) for e in needed if (layer, int(e)) in cache]
    missing = deque(int(e) for e in needed if (layer, int(e)) not in cache)
    in_flight: deque[tuple[int, Future[ReadResult]]] = deque()
    last_read_done = [0.0]  # set on the I/O threads: the read time excludes compute

    def done(_: Future[ReadResult]) -> None:
        last_read_done[0] = time.perf_counter()

    def top_up() -> None:
        todo = [missing.popleft() for _ in range(min(window - len(in_flight), len(missing)))]
        if todo:
            futures = store.submit_many([(layer, e) for e in todo])
            for future in futures:
                future.add_done_callback(done)
            in_flight.extend(zip(todo, futures, strict=True))

    outs: list[mx.array] = []
    positions: list[np.ndarray] = []
    blocked = 0.0
    reads = len(missing)
    start = time.perf_counter()
    top_up()  # reads start first: they overlap the cached experts' compute
    # The fused op spreads each part of an expert over every core: a second
    # stream would only have two experts contend for the kernel's pool
    # (measured: 1.5 of 2 cores busy, against 1.9 on one stream).
    fused = fused_glu(info, x2)
    fused = integer_glu(info, x2, xbits, as_decode, fused) or fused
    streams = [mx.default_stream(mx.default_device())] if fused else expert_streams()
    computing: deque[list[tuple[int, ReadResult, dict[str, mx.array], list[mx.array]]]] = deque()

    def settle(ran: list[tuple[int, ReadResult, dict[str, mx.array], list[mx.array]]]) -> None:
        mx.eval([o for *_, o in ran])
        for e, result, tensors, _ in ran:
            if cache.has_room(nbytes):
                cache.insert((layer, e), CachedExpert(result.buffer, tensors), nbytes)
                stats.resident(layer, 1, nbytes)
            else:
                store.recycle(result.buffer)

    try:
        for i, e in enumerate(cached):
            tensors = cache.peek((layer, e)).tensors
            with mx.stream(streams[i % len(streams)]):
                o, p = per_expert(info, x2, flat, np.array([e]), {e: tensors}, fused, token_sorts)
            outs += o
            positions += p
        while in_flight:
            batch = [in_flight.popleft()]
            # A second expert only if its read has landed: waiting for it would stall the first.
            while len(batch) < len(streams) and in_flight and in_flight[0][1].done():
                batch.append(in_flight.popleft())
            landed = []
            for e, future in batch:
                waited = time.perf_counter()
                result = future.result()  # ExpertReadError names the layer and expert
                blocked += time.perf_counter() - waited
                landed.append((e, result))
            top_up()
            ran = []
            for stream, (e, result) in zip(streams, landed, strict=False):
                tensors = store.tensors(layer, result.record)
                with mx.stream(stream):
                    o, p = per_expert(
                        info, x2, flat, np.array([e]), {e: tensors}, fused, token_sorts
                    )
                ran.append((e, result, tensors, o))
                outs += o
                positions += p
            # Computing while the next pair is built and its reads land: the stream
            # is not left idle at a sync, and the pair before is then done with
            # its records (kept, or read into again).
            mx.async_eval([o for *_, o in ran])
            computing.append(ran)
            if len(computing) > 1:
                settle(computing.popleft())
        while computing:
            settle(computing.popleft())
    except BaseException:
        for _, future in in_flight:
            future.cancel()
        if computing:
            mx.eval([o for ran in computing for *_, o in ran])  # nothing reads a recycled record
        raise
    stats.add_many(
        layer,
        {
            HITS: len(cached),
            MISSES: reads,
            DEMAND_BYTES: reads * nbytes,
            BYTES_READ: reads * nbytes,
            DEMAND_SECONDS: max(last_read_done[0] - start, 0.0) if reads else 0.0,
            BLOCKED_SECONDS: blocked,
        },
    )
    return outs, positions


def hold_room(offload: Any, tokens: int, chunk_tokens: int, reused: int = 0, held: int = 0) -> int:
    """Free the expert cache's prefill room for a prefill of `tokens` prompt tokens
    that starts from `reused` tokens of stored state (a prompt-cache hit) and
    holds `held` bytes of hidden states across its chunks.

    `offload` is the model's experts.offload.ExpertOffload. The room is what a
    prefill holds only while it runs, at most the plan's (`cache.prefill_room`):
    a chunk's activations (`cache.chunk_activation_bytes`, scaled by
    tokens / chunk_tokens up to all of it) and the held hidden states; and two
    copies of the reused state (`cache.state_bytes_per_token` each token): the private copy a hit
    hands the prefill while the stored entry stays, and the state stored when
    the prefill ends, until it replaces that entry. Evicts the policy's
    victims until that much of the capacity is free (never below two records
    per top-k slot of a layer), gives their buffers back (the spare pool keeps
    a prefill window's worth) and keeps it free until release_room. Returns
    the bytes evicted. A cache that holds every expert lends nothing.
    """
    cache: ExpertCache = offload.cache
    if cache.prefill_room <= 0:
        return 0
    chunk = cache.chunk_activation_bytes * min(1.0, tokens / max(chunk_tokens, 1))
    room = int(min(cache.prefill_room, chunk + held)) + 2 * reused * cache.state_bytes_per_token
    if cache.capacity.nbytes is not None:
        keep = 2 * max(i.top_k for i in offload.layers.values()) * max(offload.nbytes.values())
        room = min(room, max(0, cache.capacity.nbytes - keep))
    if room <= 0 or offload.all_fit:
        return 0
    cache.held = room
    freed = 0
    for victim in cache.make_room(0):
        nbytes = offload.nbytes[victim[0]]
        offload.stats.resident(victim[0], -1, -nbytes)
        offload.stats.add(victim[0], EVICTIONS)
        freed += nbytes
    if freed:
        for info in offload.layers.values():
            info.every = None  # its lists would keep the evicted experts' buffers alive
        offload.store.drop_free(keep=offload.prefill_window)
        mx.clear_cache()
    heap.enter_prefill()  # its activations' blocks reused, not faulted in afresh
    return freed


def release_room(offload: Any) -> None:
    """The prefill is over: the cache may fill its whole capacity again, and large
    blocks go back to maps of their own (compute/heap.py)."""
    offload.cache.held = 0
    heap.leave_prefill()
