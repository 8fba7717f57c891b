"""Bench section `batch`: aggregate decode tokens/s at 1, 2, 4, 8 concurrent streams."""

from __future__ import annotations

import logging
from pathlib import Path

from flashserve.engine.bench.common import (
    StreamsResult,
    bench_model,
    print_table,
    run_streams,
    start_engine,
)
from flashserve.engine.compute import blas
from flashserve.engine.config import EngineConfig
from flashserve.engine.streaming.diskio import drop_page_cache

log = logging.getLogger(__name__)

# A dense float32 llama of ~490 MB on disk (8 layers of 61 MB). Float32, not
# 4-bit: MLX's CPU 4-bit kernel costs as much per row as a whole decode step's
# I/O, so its cost grows linearly with the batch and would hide the effect
# measured here (one weight load shared by the batch). Float32 matmuls run on
# the BLAS (MKL on Linux, engine/compute/blas.py), whose cost barely grows from 1 to 8
# rows, like 4-bit kernels on a GPU.
BATCH_MODEL = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
BATCH_MOE_MODEL = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
}


def run(work_dir: Path, *, tokens: int, quick: bool) -> dict:
    """Run the batch section; print its table and targets; return its rows."""
    tiny = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    dense = (
        dict(BATCH_MODEL, **tiny, intermediate_size=512, num_hidden_layers=4)
        if quick
        else BATCH_MODEL
    )
    moe = (
        dict(
            BATCH_MOE_MODEL,
            **tiny,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=2,
            num_experts=16,
        )
        if quick
        else BATCH_MOE_MODEL
    )
    _, dense_prepared = bench_model(
        work_dir, "batch-dense-f32" + "-quick" * quick, "llama", dense, bits=None
    )
    _, moe_prepared = bench_model(
        work_dir, "batch-moe" + "-quick" * quick, "qwen3_moe", moe, expert_bits=4
    )
    experts = moe["num_experts"] * moe["num_hidden_layers"]
    configs = [
        ("resident", dense_prepared, {}),
        # Streamed layer files are evicted after each use: every step reads from disk.
        (
            "0% residency",
            dense_prepared,
            {"residency": "fixed", "resident_layers": 0, "extra": {"stream_drop_page_cache": True}},
        ),
        ("25% expert cache", moe_prepared, {"expert_cache": str(max(experts // 4, 1))}),
    ]
    rounds = 1 if quick else 2
    # (configuration, streams) -> the best round's result; noise only slows a run down.
    best: dict[tuple[str, int], StreamsResult] = {}
    for name, path, knobs in configs:
        engine = start_engine(EngineConfig(model=str(path), max_batch=8, **knobs))
        try:
            run_streams(engine, 1, 3)  # warm up compilation and allocator
            for _ in range(rounds):
                for streams in (1, 2, 4, 8):
                    drop_page_cache(path)
                    result = run_streams(engine, streams, tokens)
                    log.info("%s, %d streams: %.2f tok/s", name, streams, result.tokens_per_s)
                    old = best.get((name, streams))
                    if old is None or result.tokens_per_s > old.tokens_per_s:
                        best[name, streams] = result
        finally:
            engine.shutdown()
    rates = {key: result.tokens_per_s for key, result in best.items()}
    rows = []
    for (name, streams), result in best.items():
        single = rates[name, 1]
        loads = (
            f"{result.layer_loads / result.steps:.1f}"
            if result.layer_loads and result.steps
            else "-"
        )
        rows.append(
            [
                name,
                streams,
                result.tokens_per_s,
                result.tokens_per_s / single if single else 0.0,
                result.streams * tokens / max(result.steps, 1),
                loads,
                result.prefill_seconds,
            ]
        )
    print_table(
        f"Batched decode: aggregate decode tokens/s ({tokens} tokens per stream, best of "
        f"{rounds} round(s), page cache dropped; prefill excluded, shown apart)",
        [
            "configuration",
            "streams",
            "tokens/s",
            "x one stream",
            "tokens/step",
            "layer loads/step",
            "prefill s",
        ],
        rows,
    )
    print("\nBatched decode targets (streamed mode: 0% residency)")
    for streams, want in ((4, 2.5), (8, 4.0)):
        single = rates["0% residency", 1]
        got = rates["0% residency", streams] / single if single else 0.0
        verdict = "met" if got >= want else "MISSED"
        # Streaming cannot beat the same batch with every weight resident.
        ceiling = rates["resident", streams] / single if single else 0.0
        print(
            f"  {streams} streams / 1 stream: {got:.2f}x (target >= {want}x) {verdict}; "
            f"compute ceiling (resident {streams} streams / 0% 1 stream): {ceiling:.2f}x"
        )
    if blas.describe() == "reference":
        print(
            "  (the reference BLAS costs the same per row at any batch size, so compute grows "
            "with the batch; install mkl: pip install mkl)"
        )
    return {
        "rows": [
            {"configuration": name, "streams": streams, "tokens_per_s": result.tokens_per_s}
            for (name, streams), result in best.items()
        ]
    }
