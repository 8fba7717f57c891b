"""The `io` section of `flashserve bench`: do the read paths run at the disk's speed?

Every read of weights from SSD goes through one of two paths: the layer
streamer (weights/reader.py's FileRead: decode's streamed layers and
layer-major prefill, which holds each layer for every chunk) and the expert
store (experts/store.py: decode's misses and expert-major prefill). For each,
in one run, with the page cache dropped before every measurement and each read
evicted after use:

* the disk: the parallel read speed of the same files (4 and 8 readers, one
  file each at a time, the better of the two), measured in every round;
* the layer path alone: every layer of the ~1 GB float32 llama of the `layers`
  section acquired and released in order, as a decode pass does, with no
  compute (prefetch depth 1 and 2);
* decode at 0% residency on that llama: tokens/s against its I/O bound
  (the disk's speed / the bytes streamed per token);
* the expert path: every expert of the float32 MoE of the offloaded prefill
  rows read as expert-major prefill reads them (one layer's experts at a time,
  the next layer's reads queued before waiting), and decode's pattern (top-k
  random experts of one layer after another).

Rounds run the configurations one after another; the best round of each is
reported, because on a shared machine noise only ever slows a row down, and
each ratio divides by the disk speed of its own round.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from flashserve.engine.bench.layers import LARGE_LLAMA, PROMPT, QUICK_LLAMA, decode
from flashserve.engine.bench.layers import parallel_read_speed as _parallel
from flashserve.engine.config import EngineConfig
from flashserve.engine.streaming.diskio import drop_page_cache

log = logging.getLogger(__name__)

TARGET_READ = 0.8  # a read path's GB/s / the disk's parallel read speed
TARGET_DECODE = 0.9  # 0% residency decode / its I/O bound


@dataclass
class Measure:
    name: str
    files: str  # which files the disk speed is measured on: "layers" or "experts"
    target: float
    runs: list[tuple[float, float]] = field(default_factory=list)  # (value, disk B/s)
    unit: str = "GB/s"  # or "tok/s"
    bytes_per_token: int = 0

    def best(self) -> tuple[float, float, float]:
        """(value, disk B/s, ratio) of the round with the best ratio."""
        value, disk = max(self.runs, key=lambda r: self._ratio(*r))
        return value, disk, self._ratio(value, disk)

    def _ratio(self, value: float, disk: float) -> float:
        if self.unit == "tok/s":
            return value * self.bytes_per_token / disk if disk else 0.0
        return value / disk if disk else 0.0


def disk_speed(directory: Path) -> float:
    """The parallel read speed of the files under `directory`: the better of 4 and 8 readers."""
    return max(_parallel(directory, threads=4), _parallel(directory, threads=8))


def layer_pass(streamer: Any) -> float:
    """One decode pass's layer reads and releases, no compute; bytes/s."""
    streamer.drop_prefetched()
    drop_page_cache(streamer.root)
    total = 0
    start = time.perf_counter()
    for index in streamer.streamed_layers:
        info = streamer.layers[index]
        streamer._acquire(info)
        streamer._drop(info, ran=True)
        total += streamer.layer_bytes(index)
    elapsed = time.perf_counter() - start
    streamer.drop_prefetched()  # the last prefetch wraps around to layer 0
    return total / max(elapsed, 1e-9)


def expert_pass(store: Any, pattern: str, top_k: int, window: int, seed: int) -> float:
    """Expert reads of one pass over every MoE layer; bytes/s.

    "prefill": every expert of a layer with `window` reads in flight, as
    expert-major prefill keeps them (experts/prefill.py); a layer's reads start
    once the layer before is done, as its router needs that layer's output.
    "decode": top_k random experts of each layer, read together and awaited.
    """
    from collections import deque

    rng = random.Random(seed)
    drop_page_cache(next(iter(store.layouts.values())).file.parent)
    total = 0
    start = time.perf_counter()
    for layer in sorted(store.layouts):
        count = store.layouts[layer].num_experts
        todo = deque(range(count) if pattern == "prefill" else rng.sample(range(count), top_k))
        size = window if pattern == "prefill" else top_k
        in_flight: deque = deque()
        while todo or in_flight:
            take = [todo.popleft() for _ in range(min(size - len(in_flight), len(todo)))]
            if take:
                in_flight.extend(store.submit_many([(layer, e) for e in take]))
            result = in_flight.popleft().result()
            total += result.nbytes
            store.recycle(result.buffer)
    return total / max(time.perf_counter() - start, 1e-9)


def _models(work_dir: Path, quick: bool) -> tuple[Path, Path, int]:
    """The `layers` section's llama and the offloaded-prefill rows' MoE, prepared once."""
    from flashserve.engine.bench.common import bench_model
    from flashserve.engine.bench.prefill_offload import MOE, QUICK_MOE

    llama = bench_model(
        work_dir,
        "layers-llama-quick" if quick else "layers-llama-1gb",
        "llama",
        QUICK_LLAMA if quick else LARGE_LLAMA,
        bits=None,
    )[1]
    config = QUICK_MOE if quick else MOE
    moe = bench_model(
        work_dir, "prefill-moe-f32" + "-quick" * quick, "qwen3_moe", config, bits=None
    )[1]
    return llama, moe, int(config["num_experts_per_tok"])


def run(work_dir: Path, *, tokens: int = 32, quick: bool = False) -> list[dict]:
    """Run the read-path benchmark; print its table and targets; return the rows."""
    from flashserve.engine.bench.common import print_table
    from flashserve.engine.experts.store import ExpertStore, layouts_from_manifest
    from flashserve.engine.loader import load
    from flashserve.engine.weights.layout import read_manifest

    rounds = 1 if quick else 3
    started = time.perf_counter()
    llama, moe, top_k = _models(work_dir, quick)
    loaded = load(
        EngineConfig(model=str(llama), prefetch_depth=1, extra={"stream_drop_page_cache": True})
    )
    streamer = loaded.streamer
    streamer.apply([])
    per_token = sum(streamer.layer_bytes(i) for i in streamer.streamed_layers)
    prompt = mx.array(loaded.tokenizer.encode(PROMPT))
    layouts = layouts_from_manifest(moe, read_manifest(moe))
    store = ExpertStore(layouts, drop_page_cache=True)
    store.max_free = 4 * max(layout.num_experts for layout in layouts.values())
    window = max(2 * store.threads, 4)  # experts/offload.py's prefill window

    measures = [
        Measure("layer reads, prefetch 1 (decode, layer-major prefill)", "layers", TARGET_READ),
        Measure("layer reads, prefetch 2", "layers", TARGET_READ),
        Measure("decode 0% resident, prefetch 1", "layers", TARGET_DECODE, unit="tok/s"),
        Measure("decode 0% resident, prefetch 2", "layers", TARGET_DECODE, unit="tok/s"),
        Measure(f"expert reads, prefill ({window} in flight)", "experts", TARGET_READ),
        Measure(f"expert reads, decode (top-{top_k} per layer)", "experts", TARGET_READ),
    ]
    for m in measures:
        m.bytes_per_token = per_token
    decode(loaded.model, prompt, 3)  # warm-up: graph and allocator
    try:
        for r in range(rounds):
            disk = {
                "layers": disk_speed(llama / "layers"),
                "experts": disk_speed(moe / "experts"),
            }
            layer_reads, decodes = measures[0:2], measures[2:4]
            for depth, m in zip((1, 2), layer_reads, strict=True):
                streamer.prefetch_depth = depth
                m.runs.append((layer_pass(streamer), disk[m.files]))
            for depth, m in zip((1, 2), decodes, strict=True):
                streamer.prefetch_depth = depth
                streamer.drop_prefetched()
                gc.collect()
                drop_page_cache(llama)
                m.runs.append((decode(loaded.model, prompt, tokens), disk[m.files]))
            for pattern, m in zip(("prefill", "decode"), measures[4:6], strict=True):
                speed = expert_pass(store, pattern, top_k, window, r)
                m.runs.append((speed, disk[m.files]))
            log.info(
                "io round %d: %s",
                r,
                ", ".join(
                    f"{m.name} {m.runs[-1][0] / (1e9 if m.unit == 'GB/s' else 1):.2f}"
                    for m in measures
                ),
            )
    finally:
        store.close()
        streamer.prefetch_depth = 1
    rows, out = [], []
    for m in measures:
        value, disk, ratio = m.best()
        shown = value / 1e9 if m.unit == "GB/s" else value
        rows.append([m.name, f"{shown:.2f} {m.unit}", disk / 1e9, ratio, m.target])
        out.append(
            {
                "name": m.name,
                "value": shown,
                "unit": m.unit,
                "disk_gbps": disk / 1e9,
                "ratio": ratio,
                "target": m.target,
            }
        )
    print_table(
        f"Read paths at disk speed: {per_token / 1e9:.2f} GB of layers, "
        f"{sum(x.record_bytes * x.num_experts for x in layouts.values()) / 1e9:.2f} GB of "
        f"experts; best of {rounds} round(s), page cache dropped, reads evicted after use. "
        "Ratio: GB/s (tokens/s x bytes per token) / the disk's parallel read speed "
        "in the same round",
        ["path", "measured", "disk GB/s", "ratio", "target"],
        rows,
    )
    print("\nRead path targets")
    for row in out:
        verdict = "met" if row["ratio"] >= row["target"] else "MISSED"
        print(f"  {row['name']}: {row['ratio']:.2f}x (target >= {row['target']:.2f}x) {verdict}")
    print(f"(took {time.perf_counter() - started:.0f} s)")
    del loaded
    gc.collect()
    mx.clear_cache()
    return out
