"""The `cap` section of `flashserve bench`: a model larger than memory under a real cap.

Each server runs alone in a cgroup v1 memory group (bench/cap/runs.py: page cache
charged to it; the model's pages dropped from the page cache before each start).
Two models, `--cap-model`:

* moe (default): a ~3 GB random-weight qwen3moe GGUF (CAP_MOE), under `--cap`
  (1.2 GB). flashserve serves the prepared model with `--expert-cache auto`.
  Per run: turn 1 (a ~615-token prompt, `--tokens` decoded under a logit bias:
  EOS never, whole-word tokens favoured, text the next turn's prompt tokenizes
  back into), the next turn (prompt + answer + one short turn, sent as the
  answer ends), and a free decode (turn 1's prompt again, cached by both,
  sampled at temperature 1, EOS banned: it routes like free text) whose bytes
  read per token and the disk's speed beside it give the I/O bound. The
  model's weights are symmetric and its embeddings of unit scale
  (weights/gguf/synthetic.py says why), so it routes by token, nearly uniformly.
  flashserve runs twice: as served (prompt rows, the experts' included, on the
  integer GEMM: `prompt_matmul` int16) and with `--prompt-matmul float` (the
  experts' rows on the few-row kernel, as before issue 57), and the TTFT of
  the two is printed as a ratio.
* dense: a 1.2B-parameter dense qwen3 in Q4_0 (CAP_DENSE, 0.69 GB), under
  each of `--cap`'s limits, given as fractions of the prepared model's bytes
  (1.4x, 0.85x, 0.65x) or in bytes, and with no limit (flashserve's own
  uncapped decode: the reference for the limit where the model fits).
  flashserve serves the prepared model with `--residency auto` and nothing
  else. Per run: turn 1 (a ~660-token prompt, `--tokens` decoded: the measured
  decode, the disk's speed taken just before and after it) and the next turn.

With `--llama-server PATH`, llama.cpp's server serves the GGUF beside
flashserve, interleaved, with `--no-repack` (its default repacks the weights
into private memory, which a cap smaller than the model kills) and a context
that fits (`-c`). Also per run: private memory (RssAnon) after turn 1 and its
peak, the group's peak (page cache included, so it reaches the cap), whether
the kernel killed the server, and for flashserve its resident layers, the part
of its private memory besides weights, experts and KV, and the expert cache.

Linux and root only (it creates the cgroups).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flashserve.engine.bench.cap.runs import EOS_BIAS, CapRun, RunSpec, one_run
from flashserve.engine.bench.common import print_table
from flashserve.engine.experts.cache import Capacity
from flashserve.engine.streaming.diskio import best_random_read_speed, measure_read_speed
from flashserve.engine.weights.gguf.synthetic import (
    CAP_DENSE,
    CAP_MOE,
    FORMAT,
    QUICK_CAP_DENSE,
    QUICK_CAP_MOE,
    write_gguf,
)
from flashserve.engine.weights.layout import is_current
from flashserve.engine.weights.prepare import prepare

log = logging.getLogger(__name__)

PROMPT_WORDS = (
    "the quick brown fox jumps over lazy dog near river bank while seven old sailors "
    "argue about maps weather cargo and which star points north tonight"
)
PROMPT_TOKENS = {"moe": 615, "dense": 660}  # the issues' prompts (46, 54)
DEFAULT_CAPS = {"moe": "1.2GB", "dense": "1.4x,0.85x,0.65x"}
WORD_BIAS = 30
DECODE_DISK_BYTES = 256 << 20  # each disk measurement beside the measured decode (~0.2 s)
LLAMA_CONTEXT = {"moe": 4096, "dense": 1024}  # llama-server -c: the conversation fits
FLOAT_PROMPT = "flashserve (float prompt)"  # the MoE's run with --prompt-matmul float


def cap_model(work_dir: Path, kind: str = "moe", quick: bool = False) -> tuple[Path, Path]:
    """(GGUF file, its prepared directory) of `kind`, written once under `work_dir`."""
    shapes = {"moe": (CAP_MOE, QUICK_CAP_MOE), "dense": (CAP_DENSE, QUICK_CAP_DENSE)}
    shape = shapes[kind][1 if quick else 0]
    name = f"cap-{kind}" + ("-quick" if quick else "")
    folder = work_dir / name
    gguf_path = folder / f"{name}.gguf"
    prepared = folder / "prepared"
    stamp = folder / "shape.json"
    wanted = {**shape, "format": FORMAT}
    if not gguf_path.exists() or not stamp.exists() or json.loads(stamp.read_text()) != wanted:
        folder.mkdir(parents=True, exist_ok=True)
        log.info("writing the cap bench model %s", gguf_path)
        write_gguf(gguf_path, shape)
        stamp.write_text(json.dumps(wanted))
    if not is_current(prepared) or prepared.stat().st_mtime < gguf_path.stat().st_mtime:
        log.info("preparing %s", gguf_path)
        prepare(str(gguf_path), prepared, force=True)
    return gguf_path, prepared


def parse_cap(text: str) -> int:
    """'1.2GB' -> 1_200_000_000 bytes, '1GiB' -> 1 << 30, '500000000' -> bytes."""
    parsed = Capacity.parse(text)
    return int(parsed.nbytes if parsed.nbytes is not None else parsed.slots or 0)


def prepared_bytes(manifest: dict) -> int:
    """The model the caps are fractions of: its prepared files, the GGUF's size. Where
    flashserve's CPU kernel runs, its layers hold no more in memory either (the biases
    their scales give stay out: compute/qmm.py scaled_biases)."""
    return int(manifest["total_bytes"])


def parse_caps(text: str, model_bytes: int) -> list[int]:
    """'1.4x,0.85x,600MB' -> bytes: a fraction of `model_bytes`, or bytes as parse_cap."""
    caps = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if part.lower().endswith("x"):
            caps.append(int(float(part[:-1]) * model_bytes))
        else:
            caps.append(parse_cap(part))
    return caps


def _files(prepared: Path, kind: str) -> list[Path]:
    folder = "experts" if kind == "moe" else "layers"
    return sorted((prepared / folder).glob("*.safetensors"))


def _record(prepared: Path, kind: str) -> int:
    """The reads the disk is measured with: an expert record, or a layer file's 4 MB
    pieces (weights/reader.py CHUNK_BYTES)."""
    if kind == "dense":
        return 4 << 20
    manifest = json.loads((prepared / "manifest.json").read_text())
    return max(
        int(sw["record_bytes"])
        for entry in manifest["layers"]
        for sw in (entry.get("experts") or {}).get("switches", [])
    )


def disk_speed(gguf_path: Path, files: list[Path], record: int) -> tuple[float, float]:
    """The disk's cold read speed, bytes/s: (one reader through the GGUF, as
    llama-server's mmap reads ahead; `record`-sized reads at random places in
    `files`, the best of 4 and 8 readers through the page cache and around it, as
    flashserve reads). Measured before each run, after the page cache is dropped."""
    sequential = measure_read_speed(gguf_path)
    scattered = best_random_read_speed(files, record)
    log.info(
        "disk: %.2f GB/s one reader, %.2f GB/s random %.1f MB reads",
        sequential / 1e9,
        scattered / 1e9,
        record / 1e6,
    )
    return sequential, scattered


def _specs(kind: str, gguf_path: Path, prepared: Path, llama: Path | None) -> list[RunSpec]:
    plan = ["--expert-cache", "auto"] if kind == "moe" else ["--residency", "auto"]
    ours = [
        sys.executable, "-m", "flashserve.server.cli", "serve", "--host", "127.0.0.1",
        "--port", "PORT", "--model", str(prepared), *plan,
        "--prompt-cache-dir", "WORKDIR/prompt-cache", "--stream-keepalive", "0",
    ]  # fmt: skip
    specs = [RunSpec("flashserve", ours, prepared, flashserve=True, free_decode=kind == "moe")]
    if kind == "moe":
        floats = [*ours, "--prompt-matmul", "float"]
        specs.append(RunSpec(FLOAT_PROMPT, floats, prepared, flashserve=True, free_decode=True))
    if llama is not None:
        theirs = [
            str(llama), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", "PORT",
            "--no-repack", "-c", str(LLAMA_CONTEXT[kind]), "-t", str(os.cpu_count() or 1),
        ]  # fmt: skip
        label = "llama-server --no-repack"
        specs.append(RunSpec(label, theirs, gguf_path, flashserve=False, free_decode=kind == "moe"))
    return specs


def run(
    work_dir: Path,
    *,
    cap: str | None = None,
    tokens: int = 64,
    rounds: int = 2,
    model: Path | None = None,
    llama_server: Path | None = None,
    quick: bool = False,
    kind: str = "moe",
) -> list[dict[str, Any]]:
    """Run the section; print and return one row per (limit, round, server)."""
    if model is None:
        gguf_path, prepared = cap_model(work_dir, kind, quick=quick)
    else:
        gguf_path = Path(model)
        prepared = work_dir / f"cap-{gguf_path.stem}" / "prepared"
        if not (prepared / "manifest.json").exists():
            prepare(str(gguf_path), prepared, force=True)
    model_bytes = prepared_bytes(json.loads((prepared / "manifest.json").read_text()))
    caps: list[int | None] = list(parse_caps(cap or DEFAULT_CAPS[kind], model_bytes))
    if kind == "dense":
        caps.insert(0, None)  # flashserve's own uncapped decode: the reference
    prompt, bias = _prompt(prepared, 100 if quick else PROMPT_TOKENS[kind])
    files, record = _files(prepared, kind), _record(prepared, kind)
    runs: list[CapRun] = []
    for limit in caps:
        for rnd in range(1, rounds + 1):
            for spec in _specs(kind, gguf_path, prepared, llama_server):
                if limit is None and not spec.flashserve:
                    continue
                sequential, scattered = disk_speed(gguf_path, files, record)
                result = one_run(
                    spec,
                    cap=limit,
                    rnd=rnd,
                    tokens=tokens,
                    prompt=prompt,
                    bias=bias,
                    speed=max(sequential, scattered),
                    disk_now=lambda: best_random_read_speed(
                        files, record, direct=(True,), total=DECODE_DISK_BYTES
                    ),
                    workdir=work_dir / "cap-runs",
                )
                runs.append(result)
                log.info("cap run: %s", asdict(result))
    limits = ", ".join("none" if c is None else f"{c / 1e9:.2f} GB" for c in caps)
    title = (
        f"Cap: {prepared.parent.name} ({model_bytes / 1e9:.2f} GB) in cgroup v1 "
        f"groups of {limits}, {tokens} tokens"
    )
    print_table(title, HEADER, [_cells(r, model_bytes) for r in runs])
    if kind == "moe":
        _print_ratios(runs, caps[0] or 0)
    else:
        _print_dense_ratios(runs, model_bytes)
    return [asdict(r) for r in runs]


def _prompt(prepared: Path, tokens: int) -> tuple[str, dict[str, float]]:
    """Words drawn with a fixed seed until the model's tokenizer makes `tokens` of them,
    and the logit bias both servers get: EOS never, whole-word tokens favoured (a
    random model's free choice is bytes that print nothing until the stream ends,
    and that the next turn's text does not tokenize back into)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(prepared)
    rng = random.Random(0)
    words = PROMPT_WORDS.split()
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += " ".join(rng.choice(words) for _ in range(8)) + ". "
    bias = {str(_eos_id(prepared)): EOS_BIAS}
    for word in words:
        ids = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(ids) == 1:
            bias[str(ids[0])] = WORD_BIAS
    return text, bias


def _eos_id(prepared: Path) -> int:
    config = json.loads((prepared / "config.json").read_text())
    eos = config.get("eos_token_id", 0)
    return int(eos[0] if isinstance(eos, list) else eos)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.0f}"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEADER = [
    "server",
    "cap",
    "round",
    "OOM",
    "prompt tokens",
    "TTFT s",
    "turn-1 decode tok/s",
    "turn-1 hit rate",
    "decode tok/s",
    "MB read/token",
    "disk GB/s before",
    "disk GB/s quiet",
    "disk GB/s at decode",
    "I/O bound tok/s",
    "hit rate",
    "resident layers",
    "private MB",
    "peak private MB",
    "overhead MB",
    "experts MB",
    "cgroup peak MB",
    "next TTFT s",
    "next reused",
]


def _cells(r: CapRun, model_bytes: int) -> list[object]:
    return [
        r.server + (f" ({r.error})" if r.error else ""),
        "none" if r.cap_bytes is None else f"{r.cap_bytes / model_bytes:.2f}x",
        r.round,
        "yes" if r.oom else "no",
        r.prompt_tokens if r.prompt_tokens is not None else "-",
        _num(r.ttft_s, ".2f"),
        _num(r.biased_decode_tps, ".2f"),
        _num(r.biased_hit_rate, ".1%"),
        _num(r.decode_tps, ".2f"),
        _mb(r.read_bytes_per_token),
        f"{r.disk_bytes_per_s / 1e9:.2f}",
        f"{r.quiet_disk_bytes_per_s / 1e9:.2f}",
        _num(None if r.decode_disk_bytes_per_s is None else r.decode_disk_bytes_per_s / 1e9, ".2f"),
        _num(r.io_bound_tps, ".2f"),
        _num(r.hit_rate, ".1%"),
        r.resident_layers or "-",
        _mb(r.private_bytes),
        _mb(r.peak_private_bytes),
        _mb(r.overhead_bytes),
        _mb(r.expert_cache_bytes),
        _mb(r.cgroup_peak_bytes),
        _num(r.next_ttft_s, ".2f"),
        r.next_reused_tokens if r.next_reused_tokens is not None else "-",
    ]


def _print_ratios(runs: list[CapRun], cap: int) -> None:
    ours = [r for r in runs if r.server == "flashserve" and r.ttft_s]
    floats = [r for r in runs if r.server == FLOAT_PROMPT and r.ttft_s]
    theirs = [r for r in runs if not r.server.startswith("flashserve") and r.ttft_s]
    print("Cap targets (one run)")
    for r in ours:
        head = f"  round {r.round}:"
        if r.overhead_bytes is not None:
            print(f"{head} overhead {r.overhead_bytes / 1e6:.0f} MB (target <= 300 MB)")
        if r.expert_cache_bytes is not None:
            print(f"{head} expert cache / cap {r.expert_cache_bytes / cap:.2f}x (target >= 0.5x)")
        if r.decode_tps and r.io_bound_tps:
            print(
                f"{head} decode / I/O bound {r.decode_tps / r.io_bound_tps:.2f}x (target >= 0.8x)"
            )
        if r.next_ttft_s:
            print(f"{head} next-turn TTFT / TTFT {r.next_ttft_s / r.ttft_s:.2f}x (target <= 0.3x)")
    for a, f in zip(ours, floats, strict=False):
        print(f"  round {a.round}: TTFT int16 / float prompt: {a.ttft_s / f.ttft_s:.2f}x")  # type: ignore[operator]
    for a, b in zip(ours, theirs, strict=False):
        head = f"  round {a.round}: flashserve / llama-server --no-repack"
        print(f"{head} TTFT {a.ttft_s / b.ttft_s:.2f}x (target <= 1.0x)")  # type: ignore[operator]
        if a.decode_tps and b.decode_tps:
            print(f"{head} decode {a.decode_tps / b.decode_tps:.2f}x (target >= 6x)")


def _print_dense_ratios(runs: list[CapRun], model_bytes: int) -> None:
    """Issue 54's targets: where the model fits (a cap of 1.2x the model or more),
    decode >= 0.9x flashserve's uncapped and >= 1.0x llama-server's; below it, TTFT
    <= 1.0x llama-server's, decode >= 1.5x llama-server's and >= 0.8x its I/O bound."""
    print("Cap targets, dense (one run)")
    uncapped = [r.decode_tps for r in runs if r.cap_bytes is None and r.decode_tps]
    reference = sum(uncapped) / len(uncapped) if uncapped else None
    capped = [r for r in runs if r.cap_bytes is not None]
    for a in (r for r in capped if r.server == "flashserve"):
        head = f"  {a.cap_bytes / model_bytes:.2f}x round {a.round}:"  # type: ignore[operator]
        if a.error or a.oom:
            print(f"{head} {'OOM-killed' if a.oom else a.error} (target: serves every turn)")
            continue
        b = next(
            (
                r
                for r in capped
                if r.server != "flashserve" and (r.cap_bytes, r.round) == (a.cap_bytes, a.round)
            ),
            None,
        )
        fits = a.cap_bytes >= 1.2 * model_bytes  # type: ignore[operator]
        if fits and a.decode_tps and reference:
            print(f"{head} decode / uncapped {a.decode_tps / reference:.2f}x (target >= 0.9x)")
        if not fits and a.decode_tps and a.io_bound_tps:
            print(
                f"{head} decode / I/O bound {a.decode_tps / a.io_bound_tps:.2f}x (target >= 0.8x)"
            )
        if b is None or not b.ttft_s or not a.ttft_s:
            continue
        vs = "flashserve / llama-server --no-repack"
        if a.decode_tps and b.decode_tps:
            want = ">= 1.0x" if fits else ">= 1.5x"
            print(f"{head} {vs} decode {a.decode_tps / b.decode_tps:.2f}x (target {want})")
        if not fits:
            print(f"{head} {vs} TTFT {a.ttft_s / b.ttft_s:.2f}x (target <= 1.0x)")
        if a.next_ttft_s and b.next_ttft_s:
            print(f"{head} {vs} next-turn TTFT {a.next_ttft_s / b.next_ttft_s:.2f}x")
