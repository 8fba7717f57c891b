"""The `distributed` section of `flashserve bench`: one rank against two on this machine.

The same model (the batch section's 466 MB float32 llama, 8 layers) is served
by `flashserve serve` alone and by `flashserve serve --hostfile` with two
local ranks (layers 0-3 and 4-7, MLX's ring backend over 127.0.0.1), each in
subprocesses of their own, one after the other. A streamed completion of a
fixed prompt (EOS suppressed, greedy) gives the time to the first token and
the decode tokens/s; the per-step overhead of the split is the difference of
the two decode step times. /metrics gives the time rank 0 spent blocked in
hidden-state transfers per step, which includes waiting for the other rank's
layers.

On one machine both ranks share its cores, and MLX's ring backend polls its
socket while a receive is pending, so the waiting rank takes CPU from the
computing one: this overstates what two machines pay (docs/guides/several-machines.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from flashserve.engine.bench.batch import BATCH_MODEL
from flashserve.engine.bench.common import bench_model, free_port, free_port_run, print_table

log = logging.getLogger(__name__)

QUICK_MODEL = dict(BATCH_MODEL, hidden_size=128, intermediate_size=256, num_hidden_layers=4)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
STARTUP_S = 300.0
HOSTS = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2


@dataclass
class Result:
    ranks: int
    ttft_s: float
    tokens_per_s: float
    transfer_s_per_step: float | None  # rank 0 blocked in transfers, per step


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


def _eos_bias(model: Path) -> dict[str, int]:
    config = json.loads((model / "config.json").read_text())
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return {str(i): -100 for i in ids}


def _completion(url: str, model: Path, tokens: int) -> tuple[float, float]:
    """(time to first token, decode tokens/s) of one streamed greedy completion."""
    body = {
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "logit_bias": _eos_bias(model),
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    first = end = None
    count = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                count += 1
                end = time.perf_counter()
                first = first or end
    if first is None or end is None or count < 2:
        raise RuntimeError(f"the bench completion gave {count} tokens")
    return first - start, (count - 1) / max(end - first, 1e-9)


def _transfer_per_step(url: str) -> float | None:
    status, text = _get(f"{url}/metrics")
    found = re.search(
        r"^flashserve_distributed_transfer_seconds_per_step(?:\{[^}]*\})? ([0-9.e+-]+)$",
        text,
        re.M,
    )
    return float(found.group(1)) if status == 200 and found else None


def _serve(model: Path, ranks: int, tokens: int, rounds: int, work: Path) -> Result:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--model", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prompt-cache-bytes", "0"]
    cmd += ["--data-dir", str(work / "data"), "--log-level", "warning"]
    if ranks > 1:
        hostfile = work / "hosts.json"
        hostfile.write_text(json.dumps(HOSTS[:ranks]))
        cmd += ["--hostfile", str(hostfile), "--distributed-port", str(free_port_run(ranks))]
    log_file = open(work / f"serve-{ranks}.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        cmd, cwd=work, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + STARTUP_S
        while _get(f"{url}/health")[0] != 200:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{ranks} rank(s) did not start; see {log_file.name}")
            time.sleep(0.2)
        _completion(url, model, 4)  # warm-up
        runs = [_completion(url, model, tokens) for _ in range(rounds)]
        ttft = min(r[0] for r in runs)
        speed = max(r[1] for r in runs)
        return Result(ranks, ttft, speed, _transfer_per_step(url) if ranks > 1 else None)
    finally:
        process.terminate()  # rank 0 drains, the other ranks end with it
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        log_file.close()


def run(work_dir: Path, *, tokens: int = 32, quick: bool = False) -> list[dict]:
    """One rank against two; print the table; return the rows."""
    # The batch section's model (written once, shared); a tiny llama for --quick.
    name, config = (
        ("distributed-llama-quick", QUICK_MODEL) if quick else ("batch-dense-f32", BATCH_MODEL)
    )
    model, _ = bench_model(work_dir, name, "llama", config, bits=None)
    rounds = 1 if quick else 2
    with tempfile.TemporaryDirectory(prefix="fs-bench-dist-") as tmp:
        results = [_serve(model, ranks, tokens, rounds, Path(tmp)) for ranks in (1, 2)]
    one = results[0]
    rows, out = [], []
    for r in results:
        step_ms = 1000 / r.tokens_per_s
        overhead = step_ms - 1000 / one.tokens_per_s
        transfer = "-" if r.transfer_s_per_step is None else f"{r.transfer_s_per_step * 1000:.1f}"
        rows.append(
            [
                r.ranks,
                r.ttft_s,
                r.tokens_per_s,
                r.tokens_per_s / one.tokens_per_s,
                step_ms,
                overhead,
                transfer,
            ]
        )
        out.append(
            {
                "ranks": r.ranks,
                "ttft_s": r.ttft_s,
                "tokens_per_s": r.tokens_per_s,
                "step_overhead_ms": overhead,
            }
        )
    print_table(
        f"Distributed: one model split over ranks on this machine (ring over 127.0.0.1), "
        f"{tokens} tokens, best of {rounds}",
        [
            "ranks",
            "TTFT s",
            "tokens/s",
            "x one rank",
            "ms/step",
            "overhead ms/step",
            "rank 0 transfer ms/step",
        ],
        rows,
    )
    return out
