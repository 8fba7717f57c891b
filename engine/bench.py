"""`flashserve bench`: tokens/s and memory, side by side in one run.

Sections (all by default):
  layers   plain mlx-lm vs streaming at several residencies, prefetch on/off
  experts  MoE expert cache at several capacities, prefetch on/off, trace replay
  batch    aggregate tokens/s at 1, 2, 4, 8 concurrent streams
  prefill  prompt tokens/s of quantized models: MLX's kernel vs dequantize + BLAS

Models are random-weight models of real architectures, written once under
--work-dir and prepared for streaming. The page cache is dropped before every
configuration so streamed numbers are cold-disk numbers. This machine is
shared and noisy: read ratios between rows of one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from . import blas
from .config import EngineConfig
from .diskio import drop_page_cache
from .requests import ErrorEvent, GenerationRequest, SamplingParams
from .worker import Engine

log = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path.home() / ".cache" / "flashserve" / "bench"

# A dense float32 llama of ~490 MB on disk (8 layers of 61 MB). Float32, not
# 4-bit: MLX's CPU 4-bit kernel costs as much per row as a whole decode step's
# I/O, so its cost grows linearly with the batch and would hide the effect
# measured here (one weight load shared by the batch). Float32 matmuls run on
# the BLAS (MKL on Linux, engine/blas.py), whose cost barely grows from 1 to 8
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashserve bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="layers,experts,batch,prefill",
                        help="comma list of: layers, experts, batch, prefill")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                        help="where bench models are written once and reused")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per stream")
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke run")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    print(f"float matmuls on the {blas.describe()} BLAS")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for section in sections:
        if section == "layers":
            from .layer_bench import run as run_layers

            run_layers(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "experts":
            from .expert_bench import run as run_experts

            run_experts(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "batch":
            run_batch(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "prefill":
            from .prefill_bench import run as run_prefill

            run_prefill(args.work_dir, quick=args.quick)
        else:
            parser.error(f"unknown section {section!r}")
    return 0


# -- shared helpers ---------------------------------------------------------------


def bench_model(work_dir: Path, name: str, arch: str, overrides: dict, *,
                bits: int | None = 4, expert_bits: int | None = None) -> tuple[Path, Path]:
    """A random model (mlx-lm dir) and its prepared streaming layout, made once."""
    from .prepare import prepare
    from .synthetic import make_model_dir

    source = work_dir / name / "source"
    prepared = work_dir / name / "prepared"
    if not (source / "config.json").exists():
        log.info("writing bench model %s (%s)", name, arch)
        make_model_dir(source, arch, overrides=overrides, quantize_bits=bits, group_size=64)
    if not (prepared / "manifest.json").exists():
        log.info("preparing %s for streaming", name)
        prepare(str(source), prepared, expert_bits=expert_bits, force=True)
    return source, prepared


def start_engine(config: EngineConfig) -> Engine:
    engine = Engine(config)
    engine.start()
    if not engine.wait_ready():
        raise RuntimeError(f"bench model failed to load: {engine.load_error}")
    return engine


@dataclass
class StreamsResult:
    streams: int
    tokens: int  # decode tokens inside the timed window (all streams)
    seconds: float  # from the last stream's first token to the first stream's last token
    steps: int = 0  # worker decode steps over the whole run
    layer_loads: int = 0  # streamed-layer loads over the whole run
    prefill_seconds: float = 0.0  # submit to the last stream's first token

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_streams(engine: Engine, streams: int, tokens: int) -> StreamsResult:
    """`streams` concurrent greedy requests of `tokens` tokens; aggregate decode rate.

    Timed from the moment every stream has its first token (all prompts are
    prefilled) until the first stream ends, counting the tokens in that window:
    steady-state decode of the whole batch, the same measure as the layers
    section. Prefill is reported apart.
    """
    assert engine.loaded is not None
    tokenizer = engine.loaded.tokenizer
    streamer = engine.loaded.streamer
    # Random models may emit EOS early; a strongly negative EOS bias keeps
    # every stream at exactly `tokens` tokens.
    bias = {t: -1e9 for t in tokenizer.eos_token_ids}

    def request(i: int) -> GenerationRequest:
        # Short: on the CPU backend prefill costs about as much per token as decode.
        prompt = tokenizer.encode(f"Fox {i}:")
        return GenerationRequest(prompt, tokens, SamplingParams(temperature=0, logit_bias=bias))

    async def go() -> list[list[float]]:
        async def one(i: int) -> list[float]:
            times = []
            async for event in engine.submit(request(i)):
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(f"bench request failed: {event.message}")  # noqa: TRY004
                times.append(time.perf_counter())  # a token, or the end
            return times

        return await asyncio.gather(*(one(i) for i in range(streams)))

    steps, loads = engine.stats.steps, streamer.stats.layer_loads if streamer else 0
    start = time.perf_counter()
    per_stream = asyncio.run(go())
    # times[-1] is each stream's end event; its tokens are the events before it.
    # The window holds only steps in which every stream decodes: from the last
    # stream's first token to the first stream's last token.
    window_start = max(times[0] for times in per_stream)
    window_end = min(times[-2] for times in per_stream if len(times) > 1)
    if window_end <= window_start:  # too few tokens to overlap: time to the end
        window_end = max(times[-1] for times in per_stream)
    decoded = sum(
        1 for times in per_stream for t in times[:-1] if window_start < t <= window_end
    )
    return StreamsResult(
        streams=streams,
        tokens=decoded,
        seconds=window_end - window_start,
        steps=engine.stats.steps - steps,
        layer_loads=(streamer.stats.layer_loads if streamer else 0) - loads,
        prefill_seconds=window_start - start,
    )


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


# -- batch section ------------------------------------------------------------------


def run_batch(work_dir: Path, *, tokens: int, quick: bool) -> None:
    tiny = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
    dense = dict(BATCH_MODEL, **tiny, intermediate_size=512, num_hidden_layers=4) \
        if quick else BATCH_MODEL
    moe = dict(BATCH_MOE_MODEL, **tiny, intermediate_size=512, moe_intermediate_size=128,
               num_hidden_layers=2, num_experts=16) if quick else BATCH_MOE_MODEL
    _, dense_prepared = bench_model(work_dir, "batch-dense-f32" + "-quick" * quick, "llama",
                                    dense, bits=None)
    _, moe_prepared = bench_model(work_dir, "batch-moe" + "-quick" * quick, "qwen3_moe", moe,
                                  expert_bits=4)
    experts = moe["num_experts"] * moe["num_hidden_layers"]
    configs = [
        ("resident", dense_prepared, {}),
        # Streamed layer files are evicted after each use: every step reads from disk.
        ("0% residency", dense_prepared, {"residency": "fixed", "resident_layers": 0,
                                          "extra": {"stream_drop_page_cache": True}}),
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
        rows.append([
            name,
            streams,
            result.tokens_per_s,
            result.tokens_per_s / single if single else 0.0,
            result.streams * tokens / max(result.steps, 1),
            loads,
            result.prefill_seconds,
        ])
    print_table(
        f"Batched decode: aggregate decode tokens/s ({tokens} tokens per stream, best of "
        f"{rounds} round(s), page cache dropped; prefill excluded, shown apart)",
        ["configuration", "streams", "tokens/s", "x one stream", "tokens/step",
         "layer loads/step", "prefill s"],
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
        print("  (the reference BLAS costs the same per row at any batch size, so compute grows "
              "with the batch; install mkl: pip install mkl)")
