"""The `cap` section of `flashserve bench`: an MoE larger than memory under a real cap.

Each server runs alone in a cgroup v1 memory group capped at `--cap` (page
cache charged to it; the model's pages dropped from the page cache before
each start), serving a ~3 GB random-weight qwen3moe GGUF (cap_model.py, or
`--model`): a ~615-token prompt, `--tokens` decoded, then the same text plus
the answer and one short turn. flashserve serves the prepared model with
`--expert-cache auto`; with `--llama-server PATH`, llama.cpp's server serves
the GGUF with `--no-repack` (its default repacks weights into private memory,
which a cap smaller than the model kills). Rounds are interleaved.

The model's weights are symmetric and its embeddings of unit scale
(weights/gguf/synthetic.py says why), so it routes by token, nearly
uniformly, as the issue's "random weights route uniformly" assumes.

Per run:
- turn 1: time to first token, then `--tokens` decoded under a logit bias
  (EOS never, whole-word tokens favoured: text the next turn's prompt
  tokenizes back into); its decode rate and hit rate are printed as
  "turn-1", but the bias makes the output cycle through a few tokens, and
  the routing with it;
- the next turn: prompt + answer + one short turn, sent as the answer ends:
  its time to first token and the tokens it reused;
- decode: turn 1's prompt again (cached by both servers), `--tokens` sampled
  at temperature 1 with EOS banned, which routes like free text: decode
  tokens/s, bytes read from disk per token (/proc/PID/io), the expert
  cache's hit rate, and the I/O bound: the disk's speed for random
  expert-record reads around the page cache (the better of 4 and 8
  readers), the mean of one measurement just before the decode and one just
  after, / those bytes. The disk's speed before the run (the better of one
  reader through the GGUF and those reads) is printed beside it.
Also: private memory (RssAnon) after turn 1 and its peak (sampled every
50 ms; the peak per phase is logged), and, for flashserve, the part besides
resident weights, experts and KV (/memory); the group's peak
(memory.max_usage_in_bytes: page cache included, so it reaches the cap);
whether the kernel killed the server.

Linux and root only (it creates the cgroups).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from flashserve.engine.bench.common import free_port, print_table
from flashserve.engine.experts.cache import Capacity
from flashserve.engine.streaming.diskio import (
    best_random_read_speed,
    drop_page_cache,
    measure_read_speed,
)
from flashserve.engine.weights.gguf.synthetic import CAP_MOE, FORMAT, QUICK_CAP_MOE, write_gguf
from flashserve.engine.weights.layout import is_current
from flashserve.engine.weights.prepare import prepare

log = logging.getLogger(__name__)

V1_MEMORY = Path("/sys/fs/cgroup/memory")
PROMPT_WORDS = (
    "the quick brown fox jumps over lazy dog near river bank while seven old sailors "
    "argue about maps weather cargo and which star points north tonight"
)
PROMPT_TOKENS = 615  # the prompt
NEXT_TURN = " And then what happened next? Tell me more."
EOS_BIAS = -100
WORD_BIAS = 30
FREE_SEED = 0
DECODE_DISK_BYTES = 256 << 20  # each disk measurement beside the free decode (~0.2 s)


@dataclass
class CapRun:
    server: str
    round: int
    oom: bool
    prompt_tokens: int | None = None
    ttft_s: float | None = None
    decode_tps: float | None = None  # the free decode (uniform routing), see _free_decode
    read_bytes_per_token: float | None = None
    disk_bytes_per_s: float = 0.0  # before the server starts
    decode_disk_bytes_per_s: float | None = None  # just before and after the free decode
    io_bound_tps: float | None = None
    hit_rate: float | None = None  # the free decode's
    biased_decode_tps: float | None = None  # turn 1's decode (logit bias: skewed routing)
    biased_hit_rate: float | None = None
    private_bytes: int = 0
    peak_private_bytes: int = 0  # RssAnon sampled every 50 ms over the whole run
    overhead_bytes: int | None = None  # flashserve: private - weights - experts - KV
    expert_cache_bytes: int | None = None
    cgroup_peak_bytes: int = 0
    next_ttft_s: float | None = None
    next_reused_tokens: int | None = None
    error: str = ""


def cap_model(work_dir: Path, quick: bool = False) -> tuple[Path, Path]:
    """(GGUF file, its prepared directory), written once under `work_dir`."""
    shape = QUICK_CAP_MOE if quick else CAP_MOE
    name = "cap-moe-quick" if quick else "cap-moe"
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


def _group(cap: int, tag: str) -> Path:
    if os.geteuid() != 0 or not (V1_MEMORY / "memory.limit_in_bytes").exists():
        raise RuntimeError("the cap section needs root and a cgroup v1 memory controller")
    group = V1_MEMORY / f"flashserve-bench-cap-{os.getpid()}-{tag}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(cap))
    with contextlib.suppress(OSError):  # with swap, anonymous memory is capped too
        (group / "memory.memsw.limit_in_bytes").write_text(str(cap))
    return group


def _remove(group: Path) -> None:
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _read_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _private(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class _Turn:
    ttft: float
    seconds: float  # first token to last
    tokens: int
    text: str
    read_bytes: int  # during the decode (first token to last)
    cached: int | None
    prompt_tokens: int | None


def _stream(client: httpx.Client, pid: int, body: dict) -> _Turn:
    start = time.perf_counter()
    first = last = None
    read_at_first = 0
    text, tokens, cached, prompt_tokens = "", 0, None, None
    # A connection per request: llama-server closes one after a stream, and a
    # request on the closed one fails before it is sent.
    headers = {"Connection": "close"}
    with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            now = time.perf_counter()
            choice = (chunk.get("choices") or [{}])[0]
            if chunk.get("choices"):  # a token (its text may wait for the next one's bytes)
                if first is None:
                    first, read_at_first = now, _read_bytes(pid)
                last = now
                text += choice.get("text") or ""
                tokens += 1
            if first is not None and (choice.get("finish_reason") or chunk.get("usage")):
                last = now  # the stream's end: its last tokens may carry no text
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if "cached_tokens" in details:
                cached = details["cached_tokens"]
            if "completion_tokens" in usage:
                tokens = usage["completion_tokens"]
                prompt_tokens = usage.get("prompt_tokens")
            timings = chunk.get("timings") or {}
            if "cache_n" in timings:  # llama-server
                cached = timings["cache_n"]
    if first is None or last is None:
        raise RuntimeError("no token came back")
    read = _read_bytes(pid) - read_at_first
    return _Turn(first - start, last - first, tokens, text, read, cached, prompt_tokens)


def _serve(kind: str, model: Path, port: int, llama: Path | None, workdir: Path) -> list[str]:
    if kind == "flashserve":
        return [
            sys.executable, "-m", "flashserve.server.cli", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--model", str(model), "--expert-cache", "auto",
            "--prompt-cache-dir", str(workdir / "prompt-cache"), "--stream-keepalive", "0",
        ]  # fmt: skip
    assert llama is not None
    return [
        str(llama), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--no-repack", "-c", "4096", "-t", str(os.cpu_count() or 1),
    ]  # fmt: skip


def _one_run(
    kind: str,
    model: Path,
    *,
    cap: int,
    rnd: int,
    tokens: int,
    prompt: str,
    bias: dict[str, float],
    speed: float,
    disk_now: Callable[[], float],
    llama: Path | None,
    workdir: Path,
) -> CapRun:
    run = CapRun(
        server=kind if kind == "flashserve" else "llama-server --no-repack", round=rnd, oom=False
    )
    run.disk_bytes_per_s = speed
    drop_page_cache(model)
    group = _group(cap, f"{kind}-{rnd}")
    port = free_port()
    workdir = workdir / f"{kind}-{rnd}"
    shutil.rmtree(workdir, ignore_errors=True)  # a cold first turn: no prompt cache left
    workdir.mkdir(parents=True)
    serve = _serve(kind, model, port, llama, workdir)
    cmd = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *serve]
    log_file = open(workdir / "server.log", "wb")  # noqa: SIM115 (open while it runs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHSERVE_")}
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800)
    peak = _PeakSampler(process.pid)
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if client.get("/health").status_code == 200:
                    break
            time.sleep(0.5)
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} while loading")
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
        body["logit_bias"] = bias
        if kind != "flashserve":
            body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
        counts = _expert_counts(client) if kind == "flashserve" else None
        peak.phase("turn 1")
        turn = _stream(client, process.pid, body)
        run.ttft_s = turn.ttft
        run.prompt_tokens = turn.prompt_tokens
        run.biased_decode_tps = _tps(turn)
        run.private_bytes = _private(process.pid)
        if kind == "flashserve":
            memory = client.get("/memory").json()
            log.info(
                "flashserve /memory after turn 1: %s",
                {k: v for k, v in memory.items() if isinstance(v, int)},
            )
            run.overhead_bytes = memory.get("overhead_bytes")
            run.expert_cache_bytes = memory.get("expert_cache_bytes")
            run.biased_hit_rate = _hit_rate(counts, _expert_counts(client))
        peak.phase("next turn")
        nxt = _stream(
            client, process.pid, {**body, "prompt": prompt + turn.text + NEXT_TURN, "max_tokens": 8}
        )
        run.next_ttft_s = nxt.ttft
        run.next_reused_tokens = nxt.cached
        # Decode as a real model's routes it: the bias above makes the output cycle
        # through a few word tokens, and routing with it, so the cache hits nearly
        # always. Sampled free output (EOS banned) routes like free text; the
        # prompt is turn 1's, cached by both servers, so this request is decode.
        counts = _expert_counts(client) if kind == "flashserve" else None
        peak.phase("free decode")
        before = disk_now()
        free = _stream(
            client,
            process.pid,
            {
                **body,
                "temperature": 1.0,
                "seed": FREE_SEED,
                "logit_bias": {k: v for k, v in bias.items() if v == EOS_BIAS},
            },
        )
        after = disk_now()
        log.info(
            "disk beside the free decode: %.2f GB/s before, %.2f after", before / 1e9, after / 1e9
        )
        run.decode_disk_bytes_per_s = (before + after) / 2
        run.decode_tps = _tps(free)
        run.read_bytes_per_token = free.read_bytes / max(free.tokens - 1, 1)
        if run.read_bytes_per_token > 0:
            run.io_bound_tps = run.decode_disk_bytes_per_s / run.read_bytes_per_token
        if kind == "flashserve":
            run.hit_rate = _hit_rate(counts, _expert_counts(client))
    except (RuntimeError, httpx.HTTPError) as exc:
        run.error = str(exc)[:200]
    finally:
        run.oom = process.poll() == -signal.SIGKILL or _oom_kills(group) > 0
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        if process.poll() is None:
            process.kill()
            process.wait()
        run.oom = run.oom or _oom_kills(group) > 0
        run.peak_private_bytes = peak.stop()
        log.info(
            "%s round %d: peak private MB per phase: %s",
            kind,
            rnd,
            {name: round(value / 1e6) for name, value in peak.phases.items()},
        )
        run.cgroup_peak_bytes = int((group / "memory.max_usage_in_bytes").read_text())
        client.close()
        log_file.close()
        _remove(group)
    return run


def _expert_files(prepared: Path) -> list[Path]:
    return sorted((prepared / "experts").glob("*.safetensors"))


def disk_speed(gguf_path: Path, prepared: Path, record: int) -> tuple[float, float]:
    """The disk's cold read speed, bytes/s: (one reader through the GGUF, as
    llama-server's mmap reads ahead; `record`-sized reads at random places in the
    expert files, the best of 4 and 8 readers through the page cache and around
    it, as the expert cache reads). Measured before each run, after the page
    cache is dropped."""
    sequential = measure_read_speed(gguf_path)
    scattered = best_random_read_speed(_expert_files(prepared), record)
    log.info(
        "disk: %.2f GB/s one reader, %.2f GB/s random %.1f MB reads",
        sequential / 1e9,
        scattered / 1e9,
        record / 1e6,
    )
    return sequential, scattered


def _tps(turn: _Turn) -> float | None:
    return (turn.tokens - 1) / turn.seconds if turn.seconds > 0 else None


def _expert_counts(client: httpx.Client) -> tuple[int, int]:
    """(hits, accesses) of the expert cache since the server started."""
    stats = client.get("/cache/stats").json().get("since_start") or {}
    hits = int(stats.get("hits") or 0)
    return hits, hits + int(stats.get("prefetch_hits") or 0) + int(stats.get("misses") or 0)


def _hit_rate(before: tuple[int, int] | None, after: tuple[int, int]) -> float | None:
    hits, accesses = after[0] - (before or (0, 0))[0], after[1] - (before or (0, 0))[1]
    return hits / accesses if accesses else None


class _PeakSampler:
    """The largest RssAnon of a process, sampled every 50 ms on a thread, overall
    and per phase (`phase` names the one that starts now)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self.current = "load"
        self.phases: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def phase(self, name: str) -> None:
        self.current = name

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            value = _private(self.pid)
            self.peak = max(self.peak, value)
            self.phases[self.current] = max(self.phases.get(self.current, 0), value)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _oom_kills(group: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in (group / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def run(
    work_dir: Path,
    *,
    cap: int,
    tokens: int = 64,
    rounds: int = 2,
    model: Path | None = None,
    llama_server: Path | None = None,
    quick: bool = False,
) -> list[dict[str, Any]]:
    """Run the section; print and return one row per (round, server)."""
    if model is None:
        gguf_path, prepared = cap_model(work_dir, quick=quick)
    else:
        gguf_path = Path(model)
        prepared = work_dir / f"cap-{gguf_path.stem}" / "prepared"
        if not (prepared / "manifest.json").exists():
            prepare(str(gguf_path), prepared, force=True)
    prompt, bias = _prompt(prepared, 100 if quick else PROMPT_TOKENS)
    manifest = json.loads((prepared / "manifest.json").read_text())
    record = max(
        int(sw["record_bytes"])
        for entry in manifest["layers"]
        for sw in (entry.get("experts") or {}).get("switches", [])
    )
    files = _expert_files(prepared)
    servers = [("flashserve", prepared)]
    if llama_server is not None:
        servers.append(("llama", gguf_path))
    runs: list[CapRun] = []
    for rnd in range(1, rounds + 1):
        for kind, path in servers:
            sequential, scattered = disk_speed(gguf_path, prepared, record)
            speed = max(sequential, scattered)
            result = _one_run(
                kind,
                path,
                cap=cap,
                rnd=rnd,
                tokens=tokens,
                prompt=prompt,
                bias=bias,
                speed=speed,
                disk_now=lambda: best_random_read_speed(
                    files, record, direct=(True,), total=DECODE_DISK_BYTES
                ),
                llama=llama_server,
                workdir=work_dir / "cap-runs",
            )
            runs.append(result)
            log.info("cap run: %s", asdict(result))
    title = f"Cap: {prepared.parent.name} in a {cap / 1e9:.2f} GB cgroup v1 group, {tokens} tokens"
    print_table(title, HEADER, [_cells(r) for r in runs])
    _print_ratios(runs, cap)
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
    "round",
    "OOM",
    "prompt tokens",
    "TTFT s",
    "turn-1 decode tok/s",
    "turn-1 hit rate",
    "decode tok/s",
    "MB read/token",
    "disk GB/s before",
    "disk GB/s at decode",
    "I/O bound tok/s",
    "hit rate",
    "private MB",
    "peak private MB",
    "overhead MB",
    "experts MB",
    "cgroup peak MB",
    "next TTFT s",
    "next reused",
]


def _cells(r: CapRun) -> list[object]:
    return [
        r.server + (f" ({r.error})" if r.error else ""),
        r.round,
        "yes" if r.oom else "no",
        r.prompt_tokens if r.prompt_tokens is not None else "-",
        _num(r.ttft_s, ".2f"),
        _num(r.biased_decode_tps, ".2f"),
        _num(r.biased_hit_rate, ".1%"),
        _num(r.decode_tps, ".2f"),
        _mb(r.read_bytes_per_token),
        f"{r.disk_bytes_per_s / 1e9:.2f}",
        _num(None if r.decode_disk_bytes_per_s is None else r.decode_disk_bytes_per_s / 1e9, ".2f"),
        _num(r.io_bound_tps, ".2f"),
        _num(r.hit_rate, ".1%"),
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
    theirs = [r for r in runs if r.server != "flashserve" and r.ttft_s]
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
    for a, b in zip(ours, theirs, strict=False):
        head = f"  round {a.round}: flashserve / llama-server --no-repack"
        print(f"{head} TTFT {a.ttft_s / b.ttft_s:.2f}x (target <= 1.0x)")  # type: ignore[operator]
        if a.decode_tps and b.decode_tps:
            print(f"{head} decode {a.decode_tps / b.decode_tps:.2f}x (target >= 6x)")
