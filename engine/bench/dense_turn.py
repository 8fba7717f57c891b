"""The agent-turn section's rows for a real model size (issue 57): the 1.2B dense
qwen3 in Q4_0 that the cap bench writes (CAP_DENSE, 0.69 GB), resident.

Cold prefill of a 1,160-token prompt and of a 57-token one (tok/s of the time to
first token), with prompt chunks on the integer GEMM (`prompt_matmul` "int16", the
default) and on the float paths before it ("float": every matrix of this model
runs its prompt rows on the few-row kernel), interleaved in one engine, beside
llama.cpp's `llama-server` on the same GGUF when a binary is given. Target:
prefill >= 1.0x llama-server's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from flashserve.engine.bench.cap.section import cap_model
from flashserve.engine.bench.common import print_table, start_engine
from flashserve.engine.bench.prefill import (
    TARGET_LLAMA,
    LlamaServer,
    Measured,
    _cold,
    _prompt,
    _rounds,
)
from flashserve.engine.compute import cores, prompt_matmul
from flashserve.engine.config import EngineConfig

log = logging.getLogger(__name__)

LONG, SHORT = 1160, 57  # the prompts
QUICK_LONG, QUICK_SHORT = 160, 24


def run(work_dir: Path, binary: Path | None, rounds: int, quick: bool = False) -> dict:
    """Measure, print the table and the target's verdict; return the numbers."""
    gguf, _ = cap_model(work_dir, "dense", quick=quick)
    long, short = (QUICK_LONG, QUICK_SHORT) if quick else (LONG, SHORT)
    engine = start_engine(EngineConfig(model=str(gguf), prompt_cache_bytes=0))
    llama = None
    try:
        assert engine.loaded is not None
        model = engine.loaded.model
        prompts = {long: _prompt(engine, long), short: _prompt(engine, short, salt=5)}

        def ours(choice: str, length: int) -> Measured:
            prompt_matmul.set_prompt_matmul(model, choice)
            try:
                return _cold(engine, prompts[length])
            finally:
                prompt_matmul.set_prompt_matmul(model, "int16")

        _cold(engine, prompts[short])  # warm up
        measures = {}
        for length in (long, short):
            measures[f"int16, {length}"] = lambda n=length: ours("int16", n)
            measures[f"float (before), {length}"] = lambda n=length: ours("float", n)
        if binary is not None and binary.is_file():
            llama = LlamaServer(binary, gguf, long + 64, cores.usable())
            llama.cold(prompts[short])  # warm up
            for length in (long, short):
                measures[f"llama-server, {length}"] = lambda n=length: llama.cold(prompts[n])
        got = _rounds(measures, rounds)
    finally:
        engine.shutdown()
        if llama is not None:
            llama.close()
    print_table(
        f"Cold prefill, dense qwen3 {'(quick shape)' if quick else '1.2B'} Q4_0, best of rounds",
        ["prefill", "prompt tokens", "tok/s", "cores busy", "CPU spread"],
        [[name.rsplit(", ", 1)[0], int(name.rsplit(", ", 1)[1]), *v] for name, v in got.items()],
    )
    print("\n1.2B dense targets")
    for length in (long, short):
        rate = got[f"int16, {length}"][0]
        print(
            f"  {length} tokens, int16 / float: {rate / got[f'float (before), {length}'][0]:.2f}x"
        )
        if f"llama-server, {length}" in got:
            ratio = rate / got[f"llama-server, {length}"][0]
            verdict = "met" if ratio >= TARGET_LLAMA else "MISSED"
            target = f"(target >= {TARGET_LLAMA}x) {verdict}"
            print(f"  {length} tokens / llama-server: {ratio:.2f}x {target}")
        else:
            print(f"  {length} tokens / llama-server: not measured (no binary)")
    return {
        name: dict(zip(("tokens_per_s", "cores_busy", "cpu_spread"), v, strict=True))
        for name, v in got.items()
    }
