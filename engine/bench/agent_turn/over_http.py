"""Bench section `agent-turn`, its last part: the turns an agent sends, over HTTP, flashserve
beside llama.cpp's `llama-server` on the same GGUF (issue 57).

Both servers run as a user runs them (`flashserve serve --model GGUF`, its defaults;
`llama-server -m GGUF -t N -tb N -np 1`), both alive, measured in turns interleaved
round by round, each request streamed over /v1/completions and timed by the client:

* cold prefill of a long prompt (prompt tokens over the time to the first token);
* the time to first token of a short (~60-token) prompt;
* a conversation: a ~660-token prompt and 64 tokens of decode (EOS banned), then the
  next turn (the prompt, the answer and one short turn) whose time to first token is
  what an agent waits for every turn; both servers reuse the conversation's prefix.

Every round's prompts start with their own words, so no prefix is shared between the
measured requests except the conversation and its next turn. The rows are the best of
the rounds. The models: the default model and the 1.2B dense Q4_0 of the cap bench.

A third server, flashserve with `--prompt-matmul int8` (prompt rows rounded to 8 bits as
llama.cpp's Q8 rows are), runs beside them: int16, the default, stays within issue 57's
accuracy bound and runs at half the integer rate, which a short prompt on the 1.2B model
is bound by; the int8 column shows what the rate costs at llama.cpp's own accuracy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flashserve.engine.bench.cap.runs import NEXT_TURN, Turn, stream, tps
from flashserve.engine.bench.cap.section import _prompt as word_prompt
from flashserve.engine.bench.cap.section import cap_model
from flashserve.engine.bench.common import free_port, print_table
from flashserve.engine.bench.prefill import LlamaServer
from flashserve.engine.compute import cores
from flashserve.engine.weights.layout import is_current
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.sources import default_model_path

log = logging.getLogger(__name__)

LENGTHS = {"cold": 1160, "short": 57, "talk": 660, "decode": 64}  # the prompts
QUICK_LENGTHS = {"cold": 160, "short": 24, "talk": 100, "decode": 8}
LLAMA_CONTEXT = 2048
STARTUP_S = 600
# Other flashserve servers measured beside the default one: their command-line flags.
VARIANTS: dict[str, tuple[str, ...]] = {"flashserve int8": ("--prompt-matmul", "int8")}


@dataclass
class Measured:
    """One server's best of rounds for one model."""

    prefill_tps: float = 0.0
    prompt_tokens: int = 0
    short_ttft_s: float = float("inf")
    short_tokens: int = 0
    next_ttft_s: float = float("inf")
    next_reused: int | None = None
    decode_tps: float = 0.0
    errors: list[str] = field(default_factory=list)


class FlashServer:
    """`flashserve serve --model GGUF` as a subprocess on a free port."""

    def __init__(self, gguf: Path, work: Path, args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        shutil.rmtree(work, ignore_errors=True)  # cold: no prompt cache from an earlier run
        work.mkdir(parents=True)
        cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--model", str(gguf)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(work / "data")]
        cmd += ["--prompt-cache-dir", str(work / "prompt-cache"), *args]
        # No keepalive events: a prefill longer than stream_keepalive (5 s) would
        # send an empty text chunk, which `stream` takes for the first token.
        cmd += ["--stream-keepalive", "0"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHSERVE_")}
        self._log = open(work / "serve.log", "wb")  # noqa: SIM115 - open while it runs
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=1800)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/health").status_code == 200:
                    return
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"flashserve did not start; see {work / 'serve.log'}")

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def _prompts(prepared: Path, lengths: dict[str, int]) -> dict[str, str]:
    """Word texts of about each length (the cap bench's words: they tokenize back)."""
    return {kind: word_prompt(prepared, n)[0] for kind, n in lengths.items() if kind != "decode"}


def _measure(
    client: httpx.Client,
    pid: int,
    texts: dict[str, str],
    bias: dict[str, float],
    rnd: int,
    decode: int,
    got: Measured,
    llama: bool,
) -> None:
    """One round of the three measurements on one server, folded into its best."""
    base: dict = {"temperature": 0, "logit_bias": bias, "stream_options": {"include_usage": True}}
    if llama:
        base["ignore_eos"] = True

    def ask(prompt: str, max_tokens: int) -> Turn:
        return stream(client, pid, {**base, "prompt": prompt, "max_tokens": max_tokens})

    cold = ask(f"Prefill round {rnd}: {texts['cold']}", 1)
    tokens = cold.prompt_tokens or 0
    if tokens and tokens / cold.ttft > got.prefill_tps:
        got.prefill_tps, got.prompt_tokens = tokens / cold.ttft, tokens
    short = ask(f"Short round {rnd}: {texts['short']}", 1)
    if short.ttft < got.short_ttft_s:
        got.short_ttft_s, got.short_tokens = short.ttft, short.prompt_tokens or 0
    prompt = f"Conversation round {rnd}: {texts['talk']}"
    talk = ask(prompt, decode)
    got.decode_tps = max(got.decode_tps, tps(talk) or 0.0)
    nxt = ask(prompt + talk.text + NEXT_TURN, 8)
    if nxt.ttft < got.next_ttft_s:
        got.next_ttft_s, got.next_reused = nxt.ttft, nxt.cached


def measure_model(
    label: str,
    gguf: Path,
    prepared: Path,
    work: Path,
    binary: Path | None,
    rounds: int,
    lengths: dict[str, int],
) -> dict[str, Measured]:
    """Both servers on one model, interleaved round by round."""
    texts = _prompts(prepared, lengths)
    _, bias = word_prompt(prepared, 1)
    servers: dict[str, tuple[httpx.Client, int, bool]] = {}
    closers: list[Callable[[], None]] = []
    try:
        for name, args in {"flashserve": (), **VARIANTS}.items():
            ours = FlashServer(gguf, work / name.replace(" ", "-"), args)
            closers.append(ours.close)
            servers[name] = (ours.client, ours.proc.pid, False)
        if binary is not None and binary.is_file():
            llama = LlamaServer(binary, gguf, LLAMA_CONTEXT, cores.usable())
            closers.append(llama.close)
            servers["llama-server"] = (llama.client, llama.proc.pid, True)
        got = {name: Measured() for name in servers}
        for client, pid, _ in servers.values():  # warm up: load, first pages
            stream(client, pid, {"prompt": "Warm up.", "max_tokens": 2, "temperature": 0})
        for rnd in range(rounds):
            for name, (client, pid, is_llama) in servers.items():
                try:
                    _measure(client, pid, texts, bias, rnd, lengths["decode"], got[name], is_llama)
                except (RuntimeError, httpx.HTTPError) as exc:
                    got[name].errors.append(str(exc)[:200])
                    log.warning("%s on %s, round %d: %s", name, label, rnd, exc)
        return got
    finally:
        for close in reversed(closers):
            close()


def _ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "-"


def report(label: str, got: dict[str, Measured]) -> dict:
    """Print one model's table and its targets; return the numbers."""
    ours, theirs = got["flashserve"], got.get("llama-server")
    rows_spec = [
        ("prefill tok/s", "prefill_tps", f"{ours.prompt_tokens}-token prompt", ">= 1.0x"),
        # In ms: a next turn of 0.045 s against 0.04 s printed as 0.05 and 0.04.
        ("TTFT ms", "short_ttft_s", f"{ours.short_tokens}-token prompt", "<= 1.0x"),
        ("next-turn TTFT ms", "next_ttft_s", f"{ours.next_reused} reused", "<= 1.0x"),
        # No target: issue 57 changed the prompt path only ("decode not slower than
        # today" is the decode bench's to say); the ratio is here for the reader.
        ("decode tok/s", "decode_tps", "one stream", None),
    ]
    variants = [v for v in VARIANTS if v in got]
    rows, targets = [], {}
    for name, attr, what, target in rows_spec:
        mine = getattr(ours, attr)
        other = getattr(theirs, attr) if theirs is not None else None
        ratio = mine / other if other else None
        extra = [getattr(got[v], attr) for v in variants]
        shown = 1000.0 if attr.endswith("_s") else 1.0
        rows.append(
            [name, what, mine * shown, *(e * shown for e in extra)]
            + [other * shown if other is not None else "-", _ratio(mine, other)]
            + [_ratio(e, other) for e in extra]
        )
        if ratio is not None and target is not None:
            bound = float(target.split()[1].rstrip("x"))
            met = ratio >= bound if target.startswith(">=") else ratio <= bound
            targets[name] = {"ratio": ratio, "target": target, "met": met}
    print_table(
        f"Turns over HTTP, {label}: flashserve beside llama-server (best of rounds)",
        ["measure", "what", "flashserve", *variants, "llama-server", "flashserve / llama-server"]
        + [f"{v} / llama-server" for v in variants],
        rows,
    )
    if theirs is None:
        print("  llama-server: not measured (no binary: --llama-server PATH)")
    for name, t in targets.items():
        verdict = "met" if t["met"] else "MISSED"
        print(f"  {label}, {name}: {t['ratio']:.2f}x (target {t['target']}) {verdict}")
    for name, m in got.items():
        for error in m.errors:
            print(f"  {name} error: {error}")
    return {name: vars(m) for name, m in got.items()} | {"targets": targets}


def run(work_dir: Path, binary: Path | None, rounds: int, quick: bool = False) -> dict:
    """Both models' tables (module doc)."""
    lengths = QUICK_LENGTHS if quick else LENGTHS
    default_prepared = work_dir / "default-model-prepared"
    if not is_current(default_prepared):  # its tokenizer builds the prompts
        prepare(str(default_model_path()), default_prepared, force=True)
    dense_gguf, dense_prepared = cap_model(work_dir, "dense", quick=quick)
    dense_label = "1.2B dense Q4_0" if not quick else "dense Q4_0 (quick shape)"
    models = [
        ("default", default_model_path(), default_prepared),
        (dense_label, dense_gguf, dense_prepared),
    ]
    results = {}
    for label, gguf, prepared in models:
        work = work_dir / "turns" / label.split()[0]
        got = measure_model(label, gguf, prepared, work, binary, rounds, lengths)
        results[label] = report(label, got)
    return results
