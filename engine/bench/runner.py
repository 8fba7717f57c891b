"""`flashserve bench`: tokens/s and memory, side by side in one run.

Sections (all by default):
  layers   plain mlx-lm vs streaming at several residencies, prefetch on/off
  experts  MoE expert cache at several capacities, prefetch on/off, trace replay
  batch    aggregate tokens/s at 1, 2, 4, 8 concurrent streams
  prefill  prompt tokens/s of quantized models: MLX's kernel vs dequantize + BLAS
  prompt-cache  time to first token of an 8-turn conversation: cold, memory hit,
           disk hit after a restart, at 100% and 0% residency

Models are random-weight models of real architectures, written once under
--work-dir and prepared for streaming. The page cache is dropped before every
configuration so streamed numbers are cold-disk numbers. This machine is
shared and noisy: read ratios between rows of one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flashserve.engine.bench import batch, experts, layers, prefill, prompt_cache
from flashserve.engine.bench.common import DEFAULT_WORK_DIR
from flashserve.engine.compute import blas


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flashserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sections",
        default="layers,experts,batch,prefill,prompt-cache",
        help="comma list of: layers, experts, batch, prefill, prompt-cache",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help="where bench models are written once and reused",
    )
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per stream")
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke run")
    args = parser.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    print(f"float matmuls on the {blas.describe()} BLAS")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for section in sections:
        if section == "layers":
            layers.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "experts":
            experts.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "batch":
            batch.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "prefill":
            prefill.run(args.work_dir, quick=args.quick)
        elif section == "prompt-cache":
            prompt_cache.run(args.work_dir, quick=args.quick)
        else:
            parser.error(f"unknown section {section!r}")
    return 0
