"""The offloaded rows of the `prefill` section: time to first token from disk.

Two random float32 models, prepared for streaming:

* a dense llama at 0% residency (every decoder layer read from disk), and
* a qwen3_moe whose experts are offloaded, with an expert cache of 10% and
  25% of the expert set (attention, routers and norms resident).

For each prompt length the same request (max_tokens = 1, greedy) runs with
the model fully resident (the compute of the prompt), with layer-major
prefill (generation/prefill/layer_major.py, what `serve` does) and with mlx-lm's chunked
prefill, the page cache dropped before each row and every read evicted after
use, so a re-read costs a disk read as it would for a model far larger than
RAM. The expert cache starts empty in every row.

The bound beside each row is max(resident compute of the prompt, bytes of
one pass over the streamed weights / parallel read speed of the same disk,
measured in this run); the ratio is TTFT / bound. A further table reads the
decode hit rate of the expert cache for the same short request just before
and just after a long prompt's prefill.

The last table (issue 46) is the expert-major prefill's compute: a 4-bit
MoE of Qwen3-30B-A3B's layer shape (hidden 2048, 64 experts of 768, top-8;
4 layers), a 615-token prompt (~77 token rows per expert and layer), page
cache warm, prefilled with a 100 MB expert cache (nearly every expert read,
experts/prefill.py) and with every expert resident, each on every core and
on one thread (`one_thread`), and the expert-major one also on every core
through mlx-lm's SwitchGLU instead of one op per expert (experts/compute.py
fused_glu), two experts at a time on two streams and one at a time (as
before issue 46: only the kernel's pool splits its matmuls), in interleaved
rounds: prompt tokens/s, cores
busy (process CPU time / wall time), CPU spread (CPU time over the busiest
thread's), idle-machine tok/s (`_compute_row`: from CPU times, which other
jobs on the cores do not lengthen) and the seconds the prefill waited on
expert reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from flashserve.engine.bench.batch import BATCH_MODEL
from flashserve.engine.bench.common import bench_model, print_table, start_engine
from flashserve.engine.bench.layers import parallel_read_speed
from flashserve.engine.compute import cores, prompt_matmul, qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.experts.compute import set_concurrent_experts, set_fused_experts
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
# Issue 46's MoE layer (its cap bench's GGUF: Qwen3-30B-A3B's shape), 4-bit, 4 layers.
EXPERT_MAJOR = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "max_position_embeddings": 4096,
}
# Per-expert matmuls still big enough for the kernel to split (rows x weights >= 256K).
QUICK_EXPERT_MAJOR = dict(
    EXPERT_MAJOR,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
)
EXPERT_MAJOR_TOKENS = 615  # issue 46's prompt: ~77 token rows per expert and layer
EXPERT_MAJOR_CACHE = "100MB"  # issue 46's run: nearly every expert of a prompt is read
EXPERT_MAJOR_ROUNDS = 3


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


@contextmanager
def one_thread(on: bool = True) -> Iterator[None]:
    """Within the block (when `on`), prefill computes on one thread: prompt chunks' BLAS
    and dequantize (compute/prompt_matmul.py) and flashserve's kernel pool, which splits
    the expert matmuls; every core again after it. Between requests only."""
    if not on:
        yield
        return
    prompt_matmul.set_parallel(False)
    qmm.set_threads(1)
    try:
        yield
    finally:
        prompt_matmul.set_parallel(True)
        qmm.set_threads(cores.usable())


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, to the nanosecond (Linux schedstat:
    a short quick-mode prefill is a few clock ticks of /proc's stat)."""
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            out[task.name] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # the thread ended; no schedstat here
            continue
    return out


def _compute_row(engine: Engine, prompt: list[int]) -> list[float]:
    """One prefill's prompt tok/s, cores busy, CPU spread, idle-machine tok/s, and
    seconds blocked on expert reads.

    Idle-machine tok/s: prompt tokens / max(the busiest thread's CPU time, the
    process's CPU time / its cores). On an idle machine the wall time is at
    least both (a thread's work is sequential; the cores share the rest), and
    other jobs on the cores lengthen neither, so it compares one thread with
    every core on a busy machine, where wall-clock tok/s mostly measures them.
    """
    cpu, before = time.process_time(), _thread_cpu()  # the process's CPU, every thread
    seconds = _ttft(engine, prompt, []).seconds  # the expert cache emptied first
    total = time.process_time() - cpu
    after = _thread_cpu()
    used = [after[t] - before.get(t, 0.0) for t in after]
    busiest = max(used, default=0.0) or float("nan")  # nan: no schedstat (not Linux)
    experts = engine.loaded.experts  # type: ignore[union-attr]
    blocked = experts.snapshot().since_start.blocked_s if experts is not None else 0.0
    bound = max(busiest, total / cores.usable())
    return [
        len(prompt) / seconds,
        total / seconds,
        sum(used) / busiest,
        len(prompt) / bound,
        blocked,
    ]


def run_expert_major(work_dir: Path, *, quick: bool = False) -> list[dict]:
    """The expert-major prefill's compute on every core and on one thread (module doc)."""
    shape = QUICK_EXPERT_MAJOR if quick else EXPERT_MAJOR
    tokens = 64 if quick else EXPERT_MAJOR_TOKENS
    rounds = 1 if quick else EXPERT_MAJOR_ROUNDS
    _, prepared = bench_model(
        work_dir, "expert-major-moe" + "-quick" * quick, "qwen3_moe", shape, bits=4
    )
    prompt = _prompt(tokens, 3)
    rows: list[list[object]] = []
    every = f"{cores.usable()} cores"
    runs = {  # (threads, experts at once) per row
        f"expert-major, {EXPERT_MAJOR_CACHE} expert cache": {"expert_cache": EXPERT_MAJOR_CACHE},
        "every expert resident": {},
    }
    for label, knobs in runs.items():
        # (name, one thread, fused, template experts two at a time)
        modes = [(every, False, True, True), ("one thread", True, True, True)]
        if knobs:  # the template: two experts at a time; one (before issue 46)
            modes[1:1] = [
                (f"{every}, template, two experts at a time", False, False, True),
                (f"{every}, template, one expert at a time", False, False, False),
            ]
        engine = _engine(prepared, 512, **knobs)
        best: dict[str, list[float]] = {}
        try:
            _ttft(engine, _prompt(16, 1), [])  # warm up
            for n in range(rounds):
                for name, single, fused, concurrent in modes:
                    set_fused_experts(fused)
                    set_concurrent_experts(concurrent)
                    try:
                        with one_thread(single):
                            got = _compute_row(engine, prompt)
                    finally:
                        set_fused_experts(True)
                        set_concurrent_experts(True)
                    log.info(
                        "%s, round %d, %s: %.0f tok/s, %.2f cores busy, spread %.2f",
                        label,
                        n + 1,
                        name,
                        *got[:3],
                    )
                    if name not in best or got[0] > best[name][0]:
                        best[name] = got
        finally:
            engine.shutdown()
        base = best["one thread"]
        for name, single, *_ in modes:
            ratios = ["-", "-"] if single else [best[name][i] / base[i] for i in (0, 3)]
            rows.append([label, name, *best[name], *ratios])
    print_table(
        f"Expert-major prefill compute: {tokens}-token prompt, {shape['num_hidden_layers']} "
        f"layers of {shape['num_experts']} experts ({shape['hidden_size']} x "
        f"{shape['moe_intermediate_size']}, 4-bit), top-{shape['num_experts_per_tok']}, "
        f"page cache warm (best of {rounds})",
        [
            "model",
            "threads",
            "prompt tok/s",
            "cores busy",
            "CPU spread",
            "idle-machine tok/s",
            "blocked on reads s",
            "tok/s / one thread",
            "idle-machine tok/s / one thread",
        ],
        rows,
    )
    resident = next(r for r in rows if r[0] == "every expert resident")
    for i, name in ((2, "prompt tok/s"), (5, "idle-machine tok/s")):
        ratio = float(rows[0][i]) / float(resident[i])  # type: ignore[arg-type]
        print(f"  expert-major / resident, all cores, {name}: {ratio:.2f}x")
        ratio = float(rows[0][i]) / float(rows[1][i])  # type: ignore[arg-type]
        print(f"  expert-major, one op per expert / template two at once, {name}: {ratio:.2f}x")
        ratio = float(rows[1][i]) / float(rows[2][i])  # type: ignore[arg-type]
        print(f"  expert-major, two experts at once / one at a time, {name}: {ratio:.2f}x")
    keys = ("model", "threads", "tokens_per_s", "cores_busy", "cpu_spread", "idle_tokens_per_s")
    return [dict(zip(keys, r[:6], strict=True)) for r in rows]
