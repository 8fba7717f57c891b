"""The `prefill` section of `flashserve bench`: prompt tokens/s of quantized models,
and time to first token when weights come from disk (bench/prefill_offload.py).

Side by side in one process, for the default model (SmolLM2 Q4_1 GGUF) and a
4-bit random llama: a prompt of 32, 128 and 512 tokens prefilled through
MLX's quantized-matmul kernel, and through dequantize + BLAS matmul (what
`serve` does on the CPU, engine/compute/prompt_matmul.py). Best of three per row.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from flashserve.engine.compute import blas
from flashserve.engine.compute.prompt_matmul import use_blas_for_prompts
from flashserve.engine.config import EngineConfig

log = logging.getLogger(__name__)

LLAMA_Q4 = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
}
QUICK_LLAMA_Q4 = dict(
    LLAMA_Q4,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


def prefill_seconds(model: nn.Module, length: int, repeats: int) -> float:
    """Best time to run a `length`-token prompt into a fresh KV cache."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([[(7 * i) % 1000 + 10 for i in range(length)]])
    best = float("inf")
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        model(tokens, cache=cache)
        mx.eval([c.state for c in cache])
        best = min(best, time.perf_counter() - start)
    return best


def _set_path(model: nn.Module, blas_path: bool) -> None:
    """MLX's kernel everywhere, or what `serve` does (engine/compute/prompt_matmul.py)."""
    for _, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            module.__class__ = nn.QuantizedLinear
    if blas_path:
        use_blas_for_prompts(model)


def run(work_dir: Path, *, quick: bool = False) -> dict:
    """Both prefill tables; returns the from-disk TTFT rows (`offload`) and kernel rows."""
    from flashserve.engine.bench import prefill_offload
    from flashserve.engine.bench.common import bench_model, print_table
    from flashserve.engine.loader import load

    offload = prefill_offload.run(work_dir, quick=quick)

    lengths = (16, 64) if quick else (32, 128, 512)
    repeats = 1 if quick else 3
    llama, _ = bench_model(
        work_dir,
        "prefill-llama-q4" + "-quick" * quick,
        "llama",
        QUICK_LLAMA_Q4 if quick else LLAMA_Q4,
        bits=4,
    )
    models = [("llama q4", llama)] if quick else [("default model", None), ("llama q4", llama)]
    rows = []
    for label, path in models:
        loaded = load(EngineConfig(model=None if path is None else str(path)))
        model = loaded.model
        prefill_seconds(model, 8, 1)  # warm up
        for length in lengths:
            times = {}
            for name, blas_path in (("kernel", False), ("blas", True)):
                _set_path(model, blas_path)
                times[name] = prefill_seconds(model, length, repeats)
            log.info(
                "%s, %d tokens: kernel %.3f s, dequantize + BLAS %.3f s",
                label,
                length,
                times["kernel"],
                times["blas"],
            )
            rows.append(
                [
                    label,
                    length,
                    length / times["kernel"],
                    length / times["blas"],
                    times["kernel"] / times["blas"],
                ]
            )
        del loaded, model
    print_table(
        f"Prefill: prompt tokens/s, quantized kernel vs dequantize + {blas.describe()} BLAS "
        f"matmul (best of {repeats})",
        ["model", "prompt tokens", "kernel tok/s", "dequantize + BLAS tok/s", "speed-up"],
        rows,
    )
    keys = ("model", "prompt_tokens", "kernel_tokens_per_s", "blas_tokens_per_s", "speed_up")
    return {"offload": offload, "kernel": [dict(zip(keys, r, strict=True)) for r in rows]}
