"""`flashserve bench`: tokens/s and memory, side by side in one run.

Sections (all but cap by default):
  layers   plain mlx-lm vs streaming at several residencies, prefetch on/off
  experts  MoE expert cache at several capacities, prefetch on/off, trace replay
  batch    aggregate tokens/s at 1, 2, 4, 8 concurrent streams
  prefill  prompt tokens/s of quantized models: MLX's kernel vs dequantize + BLAS
  prompt-cache  time to first token of an 8-turn conversation: cold, memory hit,
           disk hit after a restart, at 100% and 0% residency
  io       read paths (layers, experts) against the disk's parallel read speed,
           and decode at 0% residency against its I/O bound
  distributed  one model on 1 rank and split over 2 local ranks: TTFT, tokens/s,
           the per-step overhead
  cap      a model larger than memory in cgroup-capped groups (--cap-model: an
           MoE, or a dense model at several caps), against llama-server
           --no-repack (Linux, root; not in the default list)
  decode   the default model's decode tokens/s at 1, 4, 8 streams: flashserve's
           CPU quantized matmul vs MLX's kernel (and llama.cpp when installed);
           one stream after a 4k-token prompt; kv_bits 8 and 4 against the float
           cache at 4k and 32k tokens of context
  models   several models in one server: load time, first TTFT with the load, the
           small model's TTFT while a big streamed one decodes against alone
  agent-turn  the default model: cold prefill of 1,066 tokens on all cores vs one
           thread (cores busy; llama-server's beside it with --llama-server or
           FLASHSERVE_LLAMA_SERVER), and 6k cached + 200 new tokens against its bound;
           the 1.2B dense Q4_0 model's cold prefill (1,160 and 57 tokens) on the
           integer prompt GEMM and the float path, beside llama-server; then
           both models served over HTTP beside llama-server: cold prefill of
           1,160 tokens, TTFT of 57, an agent's next turn, decode (bench/agent_turn/);
           and how far llama.cpp and the integer prompt paths move the next-token
           probabilities from the float path (the default model, --accuracy-gguf)

--plot DIR draws the numbers as PNGs in DIR (plots.py; needs matplotlib).

Models are random-weight models of real architectures, written once under
--work-dir and prepared for streaming. The page cache is dropped before every
configuration so streamed numbers are cold-disk numbers. This machine is
shared and noisy: read ratios between rows of one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashserve.engine.bench import (
    batch,
    cap,
    decode,
    distributed,
    experts,
    io,
    layers,
    models,
    plots,
    prefill,
    prompt_cache,
    speculative,
)
from flashserve.engine.bench.agent_turn import deviation, over_http
from flashserve.engine.bench.common import DEFAULT_WORK_DIR
from flashserve.engine.bench.images import section as images_section
from flashserve.engine.compute import blas
from flashserve.engine.weights.sources import default_model_path

TURN_ROUNDS = 2  # the HTTP turns: two interleaved rounds (a 1.2B round is ~1 minute)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="flashserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sections",
        default="layers,experts,batch,prefill,prompt-cache,io,distributed,decode,models,agent-turn",
        help="comma list of: layers, experts, batch, prefill, prompt-cache, io, distributed, "
        "decode, models, agent-turn, images (the vision extra), cap (Linux, root: a model "
        "larger than a cgroup's memory limit)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=DEFAULT_WORK_DIR,
        help="where bench models are written once and reused",
    )
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per stream")
    parser.add_argument("--quick", action="store_true", help="small models, for a smoke run")
    parser.add_argument(
        "--plot", type=Path, metavar="DIR", help="also write the results as PNGs into DIR"
    )
    parser.add_argument(
        "--cap",
        help="cap section: the cgroups' memory limits, comma-separated, in bytes (1.2GB) or "
        "as fractions of the prepared model (0.85x); default 1.2GB (moe), "
        "1.4x,0.85x,0.65x (dense)",
    )
    parser.add_argument(
        "--cap-model",
        choices=("moe", "dense"),
        default="moe",
        help="cap section: a ~3 GB qwen3moe (the expert cache) or a 1.2B dense qwen3 "
        "(layer streaming) larger than the cap",
    )
    parser.add_argument("--rounds", type=int, default=2, help="cap section: interleaved rounds")
    parser.add_argument(
        "--model", type=Path, help="cap section: a GGUF to serve (of --cap-model's kind)"
    )
    parser.add_argument(
        "--accuracy-gguf",
        type=Path,
        action="append",
        default=[],
        help="agent-turn section: another GGUF for the table of llama.cpp's and flashserve's "
        "deviation from the float path (repeatable; the default model is always in it)",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        help="cap and agent-turn sections: llama.cpp's server, run the same way",
    )
    args = parser.parse_args(argv)
    if args.plot is not None and (missing := plots.check()):
        parser.error(missing)  # before any section runs, not after
    args.work_dir.mkdir(parents=True, exist_ok=True)
    print(f"float matmuls on the {blas.describe()} BLAS")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    results: dict[str, Any] = {}
    for section in sections:
        if section == "layers":
            results[section] = layers.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "experts":
            results[section] = experts.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "batch":
            results[section] = batch.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "prefill":
            results[section] = prefill.run(args.work_dir, quick=args.quick)
        elif section == "prompt-cache":
            results[section] = prompt_cache.run(args.work_dir, quick=args.quick)
        elif section == "io":
            results[section] = io.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "distributed":
            results[section] = distributed.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "decode":
            results[section] = decode.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "models":
            results[section] = models.run(args.work_dir, tokens=args.tokens, quick=args.quick)
        elif section == "cap":  # not in the default list: root, cgroups, minutes per run
            results[section] = cap.run(
                args.work_dir,
                cap=args.cap,
                kind=args.cap_model,
                tokens=args.tokens,
                rounds=args.rounds,
                model=args.model,
                llama_server=args.llama_server,
                quick=args.quick,
            )
        elif section == "images":  # not in the default list: needs the vision extra
            results[section] = images_section.run(args.work_dir, quick=args.quick)
        elif section == "speculative":  # not in the default list: minutes on a CPU
            results[section] = speculative.run(args.work_dir, quick=args.quick)
        elif section == "agent-turn":
            results[section] = prefill.run_agent_turn(
                args.work_dir, llama_server=args.llama_server, quick=args.quick
            )
            binary = args.llama_server or prefill.llama_server_binary()
            results[section]["dense_1p2b"] = prefill.run_dense_turn(
                args.work_dir, binary, 1 if args.quick else prefill.ROUNDS, args.quick
            )
            results[section]["turns"] = over_http.run(
                args.work_dir, binary, 1 if args.quick else TURN_ROUNDS, args.quick
            )
            results[section]["deviation"] = deviation.run(
                [default_model_path(), *args.accuracy_gguf], binary
            )
        else:
            parser.error(f"unknown section {section!r}")
    if args.plot is not None:
        for path in plots.write(args.plot, results):
            print(f"plot: {path}")
    return 0
