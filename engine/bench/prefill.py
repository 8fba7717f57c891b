"""The `prefill` section of `flashserve bench`: prompt tokens/s of quantized models,
and time to first token when weights come from disk (bench/prefill_offload.py).

Side by side in one process, for the default model (SmolLM2 Q4_1 GGUF) and a
4-bit random llama: a prompt of 32, 128 and 512 tokens prefilled through
MLX's quantized-matmul kernel, and through dequantize + BLAS matmul (what
`serve` does on the CPU, engine/compute/prompt_matmul.py). Best of three per row.

Bench section `agent-turn` (`run_agent_turn`): the turn agents send all day, and the
cold prefill under it.

Default model (the SmolLM2 GGUF), one engine, one run (issue 42):

- Cold prefill of a 1,066-token prompt, prompt tokens/s and cores busy
  (process CPU time / wall time over the request), with prompt chunks on
  every core (compute/prompt_matmul.py: the BLAS threads and flashserve's
  dequantize) and on one thread with MLX's dequantize (as before), in
  interleaved rounds; the same at 0% residency (every layer streamed from
  disk: the threads must not starve the reader); and llama.cpp's
  `llama-server` on the same GGUF, threads = cores, when a binary is given
  (`--llama-server PATH` or FLASHSERVE_LLAMA_SERVER): its /completion
  timings (`prompt_per_second`, cache_prompt off), its process's CPU time
  over the request for its cores busy. Targets: >= 1.0x llama.cpp,
  >= 1.8 cores busy (on a 2-core machine).
- Agent turn: a 6,000-token conversation in the prompt cache's memory tier,
  then the same conversation plus 200 new tokens. Its time to first token
  beside the bound 1.3 x (cold prefill of 200 tokens + the attention of 200
  query rows over 6,200 keys in every layer, timed alone: the attention op
  on random q, k, v of the model's shapes).

A real model size (`run_dense_turn`, issue 57): the cap bench's 1.2B dense qwen3
in Q4_0 (CAP_DENSE), resident; cold prefill of 1,160 and 57 tokens with prompt
chunks on the integer GEMM (`prompt_matmul` "int16", the default) and on the
float path ("float": this model's matrices all take the few-row kernel),
interleaved, beside `llama-server` on the same GGUF. Target: >= 1.0x llama-server.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn

from flashserve.engine.bench.cap.section import cap_model
from flashserve.engine.bench.common import print_table, start_engine
from flashserve.engine.bench.prompt_cache import first_token
from flashserve.engine.compute import blas, cores, prompt_matmul
from flashserve.engine.compute.prompt_matmul import use_blas_for_prompts
from flashserve.engine.config import EngineConfig
from flashserve.engine.generation.worker import Engine
from flashserve.engine.streaming.diskio import drop_page_cache
from flashserve.engine.weights.layout import is_current
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.sources import default_model_path

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
    expert_major = prefill_offload.run_expert_major(work_dir, quick=quick)

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
    kernel = [dict(zip(keys, r, strict=True)) for r in rows]
    return {"offload": offload, "expert_major": expert_major, "kernel": kernel}


COLD_TOKENS = 1066  # the measured prompt
CACHED_TOKENS = 6000
NEW_TOKENS = 200
AGENT_TURN = {"cold": COLD_TOKENS, "cached": CACHED_TOKENS, "new": NEW_TOKENS}
QUICK_AGENT_TURN = {"cold": 160, "cached": 600, "new": 40}
ROUNDS = 3
BOUND = 1.3  # agent-turn TTFT / (cold prefill of the new tokens + their attention over the context)
TARGET_LLAMA = 1.0  # cold prefill tok/s / llama.cpp's
TARGET_CORES = 1.8  # cores busy during a cold prefill (2-core machine)
LLAMA_ENV = "FLASHSERVE_LLAMA_SERVER"

Measured = tuple[float, float, float]  # prompt tokens/s, cores busy, CPU spread
MEASURED = ("tokens_per_s", "cores_busy", "cpu_spread")


def _thread_seconds(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds of each thread of a process (Linux /proc; empty elsewhere)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        out[task.name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _spread(before: dict[str, float], after: dict[str, float]) -> float:
    """CPU time over the busiest thread's: how many cores the work was split over.

    Unlike cores busy, it does not drop when other jobs take the cores: it is
    the cores busy the same work would show on an idle machine, when the
    busiest thread is the critical path.
    """
    used = [after[t] - before.get(t, 0.0) for t in after]
    busiest = max(used, default=0.0)
    return sum(used) / busiest if busiest > 0 else 1.0


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _prompt(engine: Engine, length: int, salt: int = 0) -> list[int]:
    """`length` token ids of English text (a tokenized paragraph, repeated), `salt` varying it."""
    assert engine.loaded is not None
    text = (
        f"Turn {salt}. The agent reads the repository, runs the tests, and edits the files "
        "that fail; each tool result is appended to the conversation before the next step. "
    )
    ids = engine.loaded.tokenizer.encode(text * 8)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _cold(engine: Engine, prompt: list[int]) -> Measured:
    """(prompt tokens/s, cores busy, CPU spread) of one uncached prefill (time to first token)."""
    cpu, threads = _cpu_seconds(), _thread_seconds()
    turn = first_token(engine, prompt, use_cache=False)
    busy = (_cpu_seconds() - cpu) / turn.ttft_s
    return len(prompt) / turn.ttft_s, busy, _spread(threads, _thread_seconds())


def _attention_seconds(engine: Engine, rows: int, keys: int, repeats: int = 3) -> float:
    """The attention of `rows` new query rows over `keys` keys, every layer, timed alone."""
    assert engine.loaded is not None
    cfg = engine.loaded.config
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    key = mx.random.key(3)
    q = mx.random.normal((1, heads, rows, dim), key=key)
    k = mx.random.normal((1, kv_heads, keys, dim), key=mx.random.split(key)[0])
    v = mx.random.normal((1, kv_heads, keys, dim), key=mx.random.split(key)[1])
    mx.eval(q, k, v)
    best = float("inf")
    for _ in range(repeats):
        # As the engine runs a prompt chunk: on the prefill's threads (a no-op
        # where MKL is sequential or absent).
        with blas.prompt_threads(prompt_matmul.prompt_threads()):
            start = time.perf_counter()
            for _ in range(layers):
                out = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask="causal")
                mx.eval(out)
            best = min(best, time.perf_counter() - start)
    return best


class LlamaServer:
    """llama.cpp's server on the same GGUF, on a free port, threads = cores."""

    def __init__(self, binary: Path, gguf: Path, context: int, threads: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1"]
        args += ["-b", "2048", "-ub", "512", "--no-webui"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become ready in 120 s")

    def _cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def cold(self, prompt: list[int]) -> Measured:
        """(prompt tokens/s from its own timings, cores busy over the request, CPU spread)."""
        threads = _thread_seconds(self.proc.pid)
        cpu, start = self._cpu_seconds(), time.perf_counter()
        reply = self.client.post(
            "/completion", json={"prompt": prompt, "n_predict": 1, "cache_prompt": False}
        )
        wall = time.perf_counter() - start
        reply.raise_for_status()
        timings = reply.json()["timings"]
        busy = (self._cpu_seconds() - cpu) / wall
        return (
            float(timings["prompt_per_second"]),
            busy,
            _spread(threads, _thread_seconds(self.proc.pid)),
        )

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _rounds(measures: dict[str, Callable[[], Measured]], rounds: int) -> dict[str, Measured]:
    """Each measure once per round, interleaved; the best tok/s of each, its cores busy
    and CPU spread."""
    got: dict[str, Measured] = {}
    for n in range(rounds):
        for name, measure in measures.items():
            rate, busy, spread = measure()
            log.info(
                "round %d, %s: %.0f tok/s, %.2f cores busy, spread %.2f",
                n + 1,
                name,
                rate,
                busy,
                spread,
            )
            if name not in got or rate > got[name][0]:
                got[name] = (rate, busy, spread)
    return got


def _with_parallel(on: bool, fn: Callable[[], Measured]) -> Measured:
    prompt_matmul.set_parallel(on)
    try:
        return fn()
    finally:
        prompt_matmul.set_parallel(True)


def llama_server_binary() -> Path | None:
    """llama.cpp's server named by FLASHSERVE_LLAMA_SERVER, or None."""
    return Path(os.environ[LLAMA_ENV]) if os.environ.get(LLAMA_ENV) else None


def run_agent_turn(
    work_dir: Path, *, llama_server: Path | None = None, quick: bool = False
) -> dict:
    """Run the agent-turn section; print its tables and targets; return its numbers."""
    sizes = QUICK_AGENT_TURN if quick else AGENT_TURN
    rounds = 1 if quick else ROUNDS
    binary = llama_server or llama_server_binary()
    gguf = default_model_path()
    threads = cores.usable()
    engine = start_engine(EngineConfig(prompt_cache_bytes=2 << 30, prompt_cache_disk_bytes=0))
    llama = None
    try:
        cold = _prompt(engine, sizes["cold"])
        first_token(engine, cold[:16], use_cache=False)  # warm up
        measures = {
            "all cores": lambda: _with_parallel(True, lambda: _cold(engine, cold)),
            "one thread (before)": lambda: _with_parallel(False, lambda: _cold(engine, cold)),
        }
        llama_note: str | None = (
            f"not measured: no llama-server binary (--llama-server PATH or {LLAMA_ENV})"
        )
        if binary is not None and binary.is_file():
            llama = LlamaServer(binary, gguf, sizes["cold"] + 64, threads)
            llama.cold(cold[:16])  # warm up
            measures["llama-server"] = lambda: llama.cold(cold)  # type: ignore[union-attr]
        elif binary is not None:
            llama_note = f"not measured: {binary} is not a file"
        got = _rounds(measures, rounds)
        if llama is not None:  # before the agent turn: nothing else computes during it
            llama.close()
            llama_note = None
            llama = None
        agent = _agent_turn(engine, sizes["cached"], sizes["new"], rounds)
    finally:
        engine.shutdown()
        if llama is not None:
            llama.close()
    streamed = _streamed(work_dir, cold, rounds)
    return _report(sizes, threads, got, streamed, agent, llama_note)


def _agent_turn(engine: Engine, cached: int, new: int, rounds: int) -> dict:
    """TTFT of `cached` tokens in the memory tier + `new` ones, and the parts of its bound."""
    context = _prompt(engine, cached + new * rounds, salt=1)
    first_token(engine, context[:cached], use_cache=True)  # the conversation so far, cached
    ttfts, reused, colds = [], 0, []
    for n in range(rounds):
        # Each round sends a different 200 tokens after the same cached 6k (the
        # cache holds the 6k state; the longest prefix found is exactly it).
        turn = context[:cached] + context[cached + n * new : cached + (n + 1) * new]
        got = first_token(engine, turn, use_cache=True)
        ttfts.append(got.ttft_s)
        reused = got.cached_tokens
        colds.append(first_token(engine, _prompt(engine, new, salt=2 + n), False).ttft_s)
        log.info(
            "agent turn %d: %.2f s (%d reused); cold %d: %.2f s",
            n,
            ttfts[-1],
            reused,
            new,
            colds[-1],
        )
    attention = _attention_seconds(engine, new, cached + new)
    return {
        "ttft_s": min(ttfts),
        "reused": reused,
        "cold_new_s": min(colds),
        "attention_s": attention,
        "bound_s": BOUND * (min(colds) + attention),
    }


def _streamed(work_dir: Path, prompt: list[int], rounds: int) -> dict:
    """The cold prefill at 0% residency (every layer read from disk, page cache dropped)."""
    prepared = work_dir / "default-model-prepared"
    if not is_current(prepared):
        prepare(str(default_model_path()), prepared, force=True)
    engine = start_engine(
        EngineConfig(
            model=str(prepared),
            residency="fixed",
            resident_layers=0,
            extra={"stream_drop_page_cache": True},
        )
    )
    try:
        first_token(engine, prompt[:16], use_cache=False)

        def cold() -> Measured:
            drop_page_cache(prepared)
            return _cold(engine, prompt)

        return _rounds(
            {
                "all cores": lambda: _with_parallel(True, cold),
                "one thread (before)": lambda: _with_parallel(False, cold),
            },
            rounds,
        )
    finally:
        engine.shutdown()


def _report(
    sizes: dict, threads: int, got: dict, streamed: dict, agent: dict, llama_note: str | None
) -> dict:
    rows = [
        [where, name, sizes["cold"], rate, busy, spread]
        for where, table in (("100%", got), ("0% (streamed)", streamed))
        for name, (rate, busy, spread) in table.items()
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print_table(
        f"Cold prefill of a {sizes['cold']}-token prompt, default model, best of rounds "
        f"({threads} usable cores; load average {load:.1f} at the end)",
        ["residency", "prefill", "prompt tokens", "tok/s", "cores busy", "CPU spread"],
        rows,
    )
    rate, busy, spread = got["all cores"]
    before = got["one thread (before)"][0]
    print("\nAgent-turn targets")
    print(f"  cold prefill, all cores / one thread: {rate / before:.2f}x")
    verdict = "met" if busy >= TARGET_CORES else "MISSED"
    print(f"  cores busy: {busy:.2f} (target >= {TARGET_CORES}) {verdict}")
    print(
        f"  CPU spread (CPU time / busiest thread's; cores busy on an idle machine): {spread:.2f}"
    )
    if "llama-server" in got:
        ratio = rate / got["llama-server"][0]
        verdict = "met" if ratio >= TARGET_LLAMA else "MISSED"
        print(f"  cold prefill / llama-server: {ratio:.2f}x (target >= {TARGET_LLAMA}x) {verdict}")
    else:
        print(f"  cold prefill / llama-server: {llama_note}")
    print_table(
        f"Agent turn: {sizes['cached']} cached + {sizes['new']} new tokens (memory tier)",
        [
            "TTFT s",
            "reused",
            f"cold {sizes['new']} s",
            f"attention {sizes['new']} x {sizes['cached'] + sizes['new']} s",
            "bound s",
            "TTFT / bound",
        ],
        [
            [
                agent["ttft_s"],
                agent["reused"],
                agent["cold_new_s"],
                agent["attention_s"],
                agent["bound_s"],
                agent["ttft_s"] / agent["bound_s"],
            ]
        ],
    )
    verdict = "met" if agent["ttft_s"] <= agent["bound_s"] else "MISSED"
    print(
        f"  agent turn TTFT {agent['ttft_s']:.2f} s, bound {BOUND} x ({agent['cold_new_s']:.2f} + "
        f"{agent['attention_s']:.2f}) = {agent['bound_s']:.2f} s {verdict}"
    )
    return {
        "threads": threads,
        "cold": {k: dict(zip(MEASURED, v, strict=True)) for k, v in got.items()},
        "streamed": {k: dict(zip(MEASURED, v, strict=True)) for k, v in streamed.items()},
        "agent_turn": agent,
        "llama_server": llama_note or "measured",
    }


DENSE = (1160, 57)  # the prompts
QUICK_DENSE = (160, 24)


def run_dense_turn(work_dir: Path, binary: Path | None, rounds: int, quick: bool = False) -> dict:
    """The 1.2B dense model's rows: measure, print the table and targets, return them."""
    gguf, _ = cap_model(work_dir, "dense", quick=quick)
    lengths = QUICK_DENSE if quick else DENSE
    engine = start_engine(EngineConfig(model=str(gguf), prompt_cache_bytes=0))
    llama = None
    try:
        assert engine.loaded is not None
        model = engine.loaded.model
        prompts = {n: _prompt(engine, n, salt=i) for i, n in enumerate(lengths)}

        def ours(choice: str, length: int) -> Measured:
            prompt_matmul.set_prompt_matmul(model, choice)
            try:
                return _cold(engine, prompts[length])
            finally:
                prompt_matmul.set_prompt_matmul(model, "int16")

        _cold(engine, prompts[lengths[1]])  # warm up
        measures: dict[str, Callable[[], Measured]] = {}
        for n in lengths:
            measures[f"int16, {n}"] = lambda n=n: ours("int16", n)
            measures[f"float (before), {n}"] = lambda n=n: ours("float", n)
        if binary is not None and binary.is_file():
            llama = LlamaServer(binary, gguf, lengths[0] + 64, cores.usable())
            llama.cold(prompts[lengths[1]])  # warm up
            for n in lengths:
                measures[f"llama-server, {n}"] = lambda n=n: llama.cold(prompts[n])
        got = _rounds(measures, rounds)
    finally:
        engine.shutdown()
        if llama is not None:
            llama.close()
    size = "(quick shape)" if quick else "1.2B"
    print_table(
        f"Cold prefill, dense qwen3 {size} Q4_0, best of rounds",
        ["prefill", "prompt tokens", "tok/s", "cores busy", "CPU spread"],
        [[k.rsplit(", ", 1)[0], int(k.rsplit(", ", 1)[1]), *v] for k, v in got.items()],
    )
    print("\n1.2B dense targets")
    for n in lengths:
        rate = got[f"int16, {n}"][0]
        print(f"  {n} tokens, int16 / float: {rate / got[f'float (before), {n}'][0]:.2f}x")
        if f"llama-server, {n}" in got:
            ratio = rate / got[f"llama-server, {n}"][0]
            verdict = "met" if ratio >= TARGET_LLAMA else "MISSED"
            print(
                f"  {n} tokens / llama-server: {ratio:.2f}x (target >= {TARGET_LLAMA}x) {verdict}"
            )
        else:
            print(f"  {n} tokens / llama-server: not measured (no binary)")
    return {k: dict(zip(MEASURED, v, strict=True)) for k, v in got.items()}
