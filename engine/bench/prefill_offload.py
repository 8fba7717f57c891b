"""The offloaded rows of the `prefill` section: time to first token from disk.

Two random float32 models, prepared for streaming:

* a dense llama at 0% residency (every decoder layer read from disk), and
* a qwen3_moe whose experts are offloaded, with an expert cache of 10% and
  25% of the expert set (attention, routers and norms resident).

For each prompt length the same request (max_tokens = 1, greedy) runs with
the model fully resident (the compute of the prompt), with layer-major
prefill (generation/prefill.py, what `serve` does) and with mlx-lm's chunked
prefill, the page cache dropped before each row and every read evicted after
use, so a re-read costs a disk read as it would for a model far larger than
RAM. The expert cache starts empty in every row.

The bound beside each row is max(resident compute of the prompt, bytes of
one pass over the streamed weights / parallel read speed of the same disk,
measured in this run); the ratio is TTFT / bound. A last table reads the
decode hit rate of the expert cache for the same short request just before
and just after a long prompt's prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from flashserve.engine.bench.batch import BATCH_MODEL
from flashserve.engine.bench.common import bench_model, print_table, start_engine
from flashserve.engine.bench.layers import parallel_read_speed
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.requests import (
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.streaming.diskio import drop_page_cache

log = logging.getLogger(__name__)

# 0.49 GB float32: 8 layers of 61 MB (the batch section's model, with room for 4k tokens).
DENSE = dict(BATCH_MODEL, max_position_embeddings=8192)
# 0.8 GB of float32 experts: 8 MoE layers x 64 experts of 1.57 MB, top-8.
MOE = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "max_position_embeddings": 8192,
}
QUICK_DENSE = dict(DENSE, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
QUICK_MOE = dict(
    MOE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_experts=32,
    num_experts_per_tok=2,
)
LENGTHS = (512, 2048, 4096)
QUICK_LENGTHS = (64, 160)
CACHE_SHARES = (0.10, 0.25)
TARGET_TTFT = 1.3  # TTFT / bound of the longest prompt
TARGET_READ = 1.1  # bytes read per prefill / one pass over the streamed weights
TARGET_HITS = 0.95  # decode hit rate after a long prefill / before it


@dataclass
class Ttft:
    seconds: float
    bytes_read: int


def _prompt(length: int, salt: int) -> list[int]:
    return [(7 * i + 13 * salt) % 250 + 5 for i in range(length)]


def _request(prompt: list[int], tokens: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt, tokens, SamplingParams(temperature=0))


def _ttft(engine: Engine, prompt: list[int], disk: list[Path], cold: bool = True) -> Ttft:
    """Time to the first token of `prompt`; `cold`: page cache dropped, cache emptied."""
    loaded = engine.loaded
    assert loaded is not None
    if not cold:
        disk = []
    elif loaded.experts is not None:
        # Between requests the worker is idle: resetting from here is safe.
        loaded.experts.reset(clear_cache=True)
    if cold and loaded.streamer is not None:
        loaded.streamer.drop_prefetched()
    for path in disk:
        drop_page_cache(path)
    before = engine.weight_bytes_read()

    async def go() -> float:
        start = time.perf_counter()
        async for event in engine.submit(_request(prompt)):
            if isinstance(event, ErrorEvent):
                raise RuntimeError(f"bench request failed: {event.message}")
            if isinstance(event, TokenEvent):
                return time.perf_counter() - start
        raise RuntimeError("bench request ended without a token")

    seconds = asyncio.run(go())
    deadline = time.monotonic() + 60
    while not engine.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    # The layer prefetched for the next token at the end is the next pass's read.
    ahead = loaded.streamer.snapshot()["streaming_buffer_bytes"] if loaded.streamer else 0
    return Ttft(seconds, engine.weight_bytes_read() - before - ahead)


def _engine(prepared: Path, step: int, **knobs: object) -> Engine:
    extra = {"stream_drop_page_cache": True}
    return start_engine(
        EngineConfig(model=str(prepared), prefill_step_size=step, max_batch=1, extra=extra, **knobs)
    )


def _hit_rates(engine: Engine, long_prompt: list[int], tokens: int) -> tuple[float, float]:
    """Decode hit rate of one short request just before and just after a long prefill."""
    experts = engine.loaded.experts  # type: ignore[union-attr]
    short = _prompt(8, 99)

    def decode_hit_rate() -> float:
        before = experts.snapshot().since_start

        async def go() -> None:
            async for event in engine.submit(_request(short, tokens)):
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(event.message)

        asyncio.run(go())
        after = experts.snapshot().since_start
        hits = after.hits - before.hits
        misses = after.misses + after.prefetch_hits - before.misses - before.prefetch_hits
        return hits / max(hits + misses, 1)

    experts.reset(clear_cache=True)
    decode_hit_rate()  # warm: the cache holds this request's working set
    before = decode_hit_rate()
    _ttft(engine, long_prompt, [], cold=False)
    return before, decode_hit_rate()


def run(work_dir: Path, *, quick: bool = False) -> list[dict]:
    """The offloaded-prefill tables (see the module doc); returns the TTFT rows."""
    lengths = QUICK_LENGTHS if quick else LENGTHS
    step = 32 if quick else 512
    speed_of = parallel_read_speed
    dense, moe = (
        bench_model(work_dir, name + "-quick" * quick, arch, config, bits=None)[1]
        for name, arch, config in (
            ("prefill-dense-f32", "llama", QUICK_DENSE if quick else DENSE),
            ("prefill-moe-f32", "qwen3_moe", QUICK_MOE if quick else MOE),
        )
    )
    rows: list[list[object]] = []
    layer_bytes = sum(f.stat().st_size for f in (dense / "layers").iterdir())
    expert_bytes = sum(f.stat().st_size for f in (moe / "experts").iterdir())
    dense_speed = speed_of(dense / "layers")
    moe_speed = speed_of(moe / "experts")
    log.info(
        "parallel read speed: %.2f GB/s (layers), %.2f GB/s (experts)",
        dense_speed / 1e9,
        moe_speed / 1e9,
    )

    def measure(label: str, prepared: Path, pass_bytes: int, speed: float, knobs: dict) -> None:
        disk = [prepared / "layers", prepared / "experts"]
        resident = _engine(prepared, step)
        timed = {}
        try:
            for n in lengths:
                _ttft(resident, _prompt(16, n), disk)  # warm up
                timed[n] = _ttft(resident, _prompt(n, n), disk).seconds
        finally:
            resident.shutdown()
        results: dict[str, dict[int, Ttft]] = {}
        for order in ("auto", "chunked"):
            engine = _engine(prepared, step, prefill_order=order, **knobs)
            try:
                _ttft(engine, _prompt(16, 1), disk)  # warm up
                results[order] = {n: _ttft(engine, _prompt(n, n), disk) for n in lengths}
            finally:
                engine.shutdown()
        for n in lengths:
            bound = max(timed[n], pass_bytes / speed)
            lm, ch = results["auto"][n], results["chunked"][n]
            rows.append(
                [
                    label,
                    n,
                    timed[n],
                    pass_bytes / speed,
                    bound,
                    lm.seconds,
                    lm.seconds / bound,
                    lm.bytes_read / pass_bytes,
                    ch.seconds,
                    ch.bytes_read / pass_bytes,
                ]
            )
            log.info(
                "%s, %d tokens: layer-major %.2f s, chunked %.2f s",
                label,
                n,
                lm.seconds,
                ch.seconds,
            )

    measure(
        "dense f32, 0% resident",
        dense,
        layer_bytes,
        dense_speed,
        {"residency": "fixed", "resident_layers": 0},
    )
    for share in CACHE_SHARES:
        measure(
            f"MoE f32, {share:.0%} expert cache",
            moe,
            expert_bytes,
            moe_speed,
            {"expert_cache": f"{int(expert_bytes * share)}B"},
        )
    print_table(
        "Prefill from disk: time to first token (s), page cache dropped, reads evicted after use",
        [
            "model",
            "prompt tokens",
            "resident s",
            "one pass / disk s",
            "bound s",
            "layer-major s",
            "/ bound",
            "read / one pass",
            "chunked s",
            "chunked read / one pass",
        ],
        rows,
    )
    # 25%: one decoded token needs top-k experts of every layer, more than 10% holds.
    share = CACHE_SHARES[-1]
    engine = _engine(moe, step, expert_cache=f"{int(expert_bytes * share)}B")
    try:
        before, after = _hit_rates(engine, _prompt(lengths[-1], 7), 24 if quick else 48)
    finally:
        engine.shutdown()
    kept = after / before if before else float("nan")
    print_table(
        f"Expert cache ({share:.0%}): decode hit rate of one request before and "
        f"after a {lengths[-1]}-token prefill",
        ["before", "after", "after / before"],
        [[before, after, kept]],
    )
    longest = [r for r in rows if r[1] == lengths[-1]]
    targets = [
        (f"{r[0]}, {r[1]} tokens: TTFT / bound", float(r[6]), TARGET_TTFT, "<=") for r in longest
    ]
    targets += [
        (f"{r[0]}, {r[1]} tokens: bytes read / one pass", float(r[7]), TARGET_READ, "<=")
        for r in longest
    ]
    targets.append(("decode hit rate after / before the prefill", kept, TARGET_HITS, ">="))
    print("\nTargets (prefill from disk)")
    for name, value, target, sense in targets:
        met = value <= target if sense == "<=" else value >= target
        print(f"  {name}: {value:.2f}x (target {sense} {target}x) {'met' if met else 'MISSED'}")
    keys = ("model", "prompt_tokens", "resident_s", "layer_major_s", "chunked_s")
    return [dict(zip(keys, (r[0], r[1], r[2], r[5], r[8]), strict=True)) for r in rows]
