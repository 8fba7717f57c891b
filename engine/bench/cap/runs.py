"""One server run of the cap bench (bench/cap/section.py) inside a cgroup v1 memory group.

The server (flashserve or llama-server, its command line given) starts alone
in a fresh group capped at the run's limit (page cache charged to it; the
model's pages dropped from the page cache first), or with no limit (the
uncapped reference run). Then: turn 1 (time to first token, decode rate,
bytes read from disk per decoded token from /proc/PID/io), the next turn
(prompt + answer + a short turn, sent as the answer ends), and for an MoE a
free decode (sampled, EOS banned) that routes like text. The disk's speed is
measured just before and just after the decode that gives the I/O bound.
Private memory (RssAnon) is sampled every 50 ms; whether the kernel killed
the server is read from the group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from flashserve.engine.bench.common import free_port
from flashserve.engine.streaming.diskio import drop_page_cache

log = logging.getLogger(__name__)

V1_MEMORY = Path("/sys/fs/cgroup/memory")
NEXT_TURN = " And then what happened next? Tell me more."
EOS_BIAS = -100
FREE_SEED = 0


@dataclass
class CapRun:
    server: str
    round: int
    oom: bool
    cap_bytes: int | None = None  # None: no limit (the uncapped reference)
    prompt_tokens: int | None = None
    ttft_s: float | None = None
    decode_tps: float | None = None  # the measured decode (an MoE's free decode)
    read_bytes_per_token: float | None = None
    disk_bytes_per_s: float = 0.0  # before the server starts
    # The decode's measurement (around the page cache) taken just before the server
    # starts: what the disk gives while no server uses it.
    quiet_disk_bytes_per_s: float = 0.0
    decode_disk_bytes_per_s: float | None = None  # just before and after that decode
    io_bound_tps: float | None = None
    hit_rate: float | None = None  # an MoE's free decode's
    biased_decode_tps: float | None = None  # turn 1's decode (logit bias: skewed routing)
    biased_hit_rate: float | None = None
    private_bytes: int = 0
    peak_private_bytes: int = 0  # RssAnon sampled every 50 ms over the whole run
    overhead_bytes: int | None = None  # flashserve: private - weights - experts - KV
    expert_cache_bytes: int | None = None
    resident_layers: str | None = None  # flashserve: "resident/all" after turn 1
    cgroup_peak_bytes: int = 0
    next_ttft_s: float | None = None
    next_reused_tokens: int | None = None
    error: str = ""


@dataclass
class RunSpec:
    """What one run serves and how it is measured."""

    label: str  # the table's server column
    command: list[str]  # the server's command line; PORT is replaced by its port
    model: Path  # whose pages are dropped from the page cache first
    flashserve: bool
    free_decode: bool  # an MoE: measure decode on a free (sampled) request


def make_group(cap: int | None, tag: str) -> Path:
    """A fresh cgroup v1 memory group capped at `cap` bytes (None: no limit)."""
    if os.geteuid() != 0 or not (V1_MEMORY / "memory.limit_in_bytes").exists():
        raise RuntimeError("the cap section needs root and a cgroup v1 memory controller")
    group = V1_MEMORY / f"flashserve-bench-cap-{os.getpid()}-{tag}"
    group.mkdir()
    if cap is not None:
        (group / "memory.limit_in_bytes").write_text(str(cap))
        with contextlib.suppress(OSError):  # with swap, anonymous memory is capped too
            (group / "memory.memsw.limit_in_bytes").write_text(str(cap))
    return group


def remove_group(group: Path) -> None:
    for _ in range(100):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def read_bytes(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def private(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Turn:
    ttft: float
    seconds: float  # first token to last
    tokens: int
    text: str
    read_bytes: int  # during the decode (first token to last)
    cached: int | None
    prompt_tokens: int | None


def stream(client: httpx.Client, pid: int, body: dict) -> Turn:
    """One streamed /v1/completions request, timed."""
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
                    first, read_at_first = now, read_bytes(pid)
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
    read = read_bytes(pid) - read_at_first
    return Turn(first - start, last - first, tokens, text, read, cached, prompt_tokens)


def tps(turn: Turn) -> float | None:
    return (turn.tokens - 1) / turn.seconds if turn.seconds > 0 else None


def one_run(
    spec: RunSpec,
    *,
    cap: int | None,
    rnd: int,
    tokens: int,
    prompt: str,
    bias: dict[str, float],
    speed: float,
    disk_now: Callable[[], float],
    workdir: Path,
) -> CapRun:
    """Serve `spec` alone in a group capped at `cap`; turn 1, the next turn and the
    measured decode (module doc)."""
    run = CapRun(server=spec.label, round=rnd, oom=False, cap_bytes=cap)
    run.disk_bytes_per_s = speed
    run.quiet_disk_bytes_per_s = disk_now()
    drop_page_cache(spec.model)
    # The label whole: two flashserve runs (bench/cap/section.py) need two folders.
    tag = f"{re.sub(r'[^A-Za-z0-9]+', '-', spec.label).strip('-')}-{rnd}-{cap or 0}"
    group = make_group(cap, tag)
    port = free_port()
    workdir = workdir / tag
    shutil.rmtree(workdir, ignore_errors=True)  # a cold first turn: no prompt cache left
    workdir.mkdir(parents=True)
    serve = [
        part.replace("PORT", str(port)).replace("WORKDIR", str(workdir)) for part in spec.command
    ]
    cmd = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *serve]
    log_file = open(workdir / "server.log", "wb")  # noqa: SIM115 (open while it runs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHSERVE_")}
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800)
    peak = PeakSampler(process.pid)
    try:
        deadline = time.monotonic() + 1800
        while time.monotonic() < deadline and process.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if client.get("/health").status_code == 200:
                    break
            time.sleep(0.5)
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} while loading")
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "logit_bias": bias}
        if not spec.flashserve:
            body["ignore_eos"] = True
        body["stream_options"] = {"include_usage": True}
        counts = expert_counts(client) if spec.flashserve else None
        peak.phase("turn 1")
        before = None if spec.free_decode else disk_now()
        turn = stream(client, process.pid, body)
        if not spec.free_decode:  # turn 1's decode is the measured one
            _measured(run, turn, before, disk_now())
        run.ttft_s = turn.ttft
        run.prompt_tokens = turn.prompt_tokens
        run.biased_decode_tps = tps(turn)
        run.private_bytes = private(process.pid)
        if spec.flashserve:
            memory = client.get("/memory").json()
            log.info(
                "flashserve /memory after turn 1: %s",
                {k: v for k, v in memory.items() if isinstance(v, int)},
            )
            run.overhead_bytes = memory.get("overhead_bytes")
            run.resident_layers = f"{len(memory['resident_layers'])}/{memory['num_layers']}"
            if memory.get("expert_cache_bytes"):
                run.expert_cache_bytes = memory.get("expert_cache_bytes")
                run.biased_hit_rate = hit_rate(counts, expert_counts(client))
        peak.phase("next turn")
        nxt = stream(
            client, process.pid, {**body, "prompt": prompt + turn.text + NEXT_TURN, "max_tokens": 8}
        )
        run.next_ttft_s = nxt.ttft
        run.next_reused_tokens = nxt.cached
        if spec.free_decode:
            # Decode as a real MoE routes it: the bias above makes the output cycle
            # through a few word tokens, and routing with it, so the cache hits nearly
            # always. Sampled free output (EOS banned) routes like free text; the
            # prompt is turn 1's, cached by both servers, so this request is decode.
            counts = expert_counts(client) if spec.flashserve else None
            peak.phase("free decode")
            before = disk_now()
            free = stream(
                client,
                process.pid,
                {
                    **body,
                    "temperature": 1.0,
                    "seed": FREE_SEED,
                    "logit_bias": {k: v for k, v in bias.items() if v == EOS_BIAS},
                },
            )
            _measured(run, free, before, disk_now())
            if spec.flashserve:
                run.hit_rate = hit_rate(counts, expert_counts(client))
    except (RuntimeError, httpx.HTTPError) as exc:
        run.error = str(exc)[:200]
    finally:
        run.oom = process.poll() == -signal.SIGKILL or oom_kills(group) > 0
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        if process.poll() is None:
            process.kill()
            process.wait()
        run.oom = run.oom or oom_kills(group) > 0
        run.peak_private_bytes = peak.stop()
        log.info(
            "%s round %d: peak private MB per phase: %s",
            spec.label,
            rnd,
            {name: round(value / 1e6) for name, value in peak.phases.items()},
        )
        run.cgroup_peak_bytes = int((group / "memory.max_usage_in_bytes").read_text())
        client.close()
        log_file.close()
        remove_group(group)
    return run


def _measured(run: CapRun, turn: Turn, before: float | None, after: float) -> None:
    """The decode the I/O bound is read from: its rate, bytes per token, and the disk's
    speed as the mean of the measurements just before and just after it. The bound
    divides by the larger of that and the same measurement taken just before the
    server started: a server's own work beside its decode (its start, a prompt
    state written to the disk tier after the answer) slows those in its favour."""
    log.info(
        "disk beside the decode: %.2f GB/s before, %.2f after", (before or 0) / 1e9, after / 1e9
    )
    run.decode_disk_bytes_per_s = ((before or after) + after) / 2
    run.decode_tps = tps(turn)
    run.read_bytes_per_token = turn.read_bytes / max(turn.tokens - 1, 1)
    if run.read_bytes_per_token >= 1 << 20:  # else the weights do not come from disk
        disk = max(run.decode_disk_bytes_per_s, run.quiet_disk_bytes_per_s)
        run.io_bound_tps = disk / run.read_bytes_per_token


def expert_counts(client: httpx.Client) -> tuple[int, int]:
    """(hits, accesses) of the expert cache since the server started (0s: none)."""
    stats = client.get("/cache/stats").json().get("since_start") or {}
    hits = int(stats.get("hits") or 0)
    return hits, hits + int(stats.get("prefetch_hits") or 0) + int(stats.get("misses") or 0)


def hit_rate(before: tuple[int, int] | None, after: tuple[int, int]) -> float | None:
    hits, accesses = after[0] - (before or (0, 0))[0], after[1] - (before or (0, 0))[1]
    return hits / accesses if accesses else None


class PeakSampler:
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
            value = private(self.pid)
            self.peak = max(self.peak, value)
            self.phases[self.current] = max(self.phases.get(self.current, 0), value)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def oom_kills(group: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in (group / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0
