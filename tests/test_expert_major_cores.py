"""Expert-major prefill on every core is token-identical to the resident model (issue 46).

An MoE whose experts are offloaded prefills expert-major (experts/prefill.py):
each needed expert runs once on all of its token rows, as one op of
flashserve's kernel (or through mlx-lm's SwitchGLU, two experts at once on
two MLX streams where there are two cores), its matmuls on the kernel,
which splits a matmul of 256K weights x rows or more over its thread pool
(compute/csrc/qmm_kernels.cpp). The tiny models here
are wide enough (hidden 256, experts of 128) that a 64-token chunk's
per-expert matmuls cross that threshold, so they run split over the cores.
Greedy output through the real server must be the fully resident model's at
any chunking and expert cache size, and the same on one core: on the default
integer prompt GEMM (a resident model's experts take it too:
compute/prompt_experts.py), and on the float paths each way of computing an
expert takes (test_every_expert_path_matches_resident).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

from .conftest import NO_EOS, start_server, stop_server

PROMPTS = [
    [(7 * i) % 250 + 5 for i in range(300)],
    [(11 * i + 3) % 250 + 5 for i in range(170)],
]
TOKENS = 12
# Per-expert matmul: ~16 token rows (64 tokens x top-2 / 8 experts) x 256 x 128 weights.
WIDE = {"hidden_size": 256, "intermediate_size": 128, "moe_intermediate_size": 128}


def _complete(server, prompt: list[int]) -> tuple[str, list[float]]:
    """Greedy text and the chosen tokens' logprobs (the same numbers bit for bit)."""
    choice = (
        server.client()
        .completions.create(
            model=server.model_id,
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0,
            logit_bias=NO_EOS,
            logprobs=1,
        )
        .choices[0]
    )
    return choice.text, list(choice.logprobs.token_logprobs)


def _outputs(model: Path, work: Path, *args: str, cpus: set[int] | None = None) -> dict:
    """Every prompt's greedy output from a server started with `args` (on `cpus` only)."""
    work.mkdir(parents=True)
    mask = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # the server process inherits this thread's mask
    try:
        server = start_server(model, work, *args)
    finally:
        os.sched_setaffinity(0, mask)
    try:
        got = {i: _complete(server, p) for i, p in enumerate(PROMPTS)}
        assert server.health().json()["stats"]["requests_failed"] == 0
        log = server.log_tail(10**7)
    finally:
        stop_server(server)
    threads = len(cpus) if cpus is not None else len(mask)
    # The kernel's pool: one thread per core the server may use.
    assert f"flashserve's CPU kernel ({threads} threads)" in log, log[-2000:]
    return got


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_major_prefill_on_every_core_matches_resident(tmp_path: Path, arch: str) -> None:
    source = make_model_dir(tmp_path / "src", arch, overrides=WIDE)
    prepared = prepare(str(source), tmp_path / "prepared", expert_bits=4)
    one_core = {min(os.sched_getaffinity(0))}
    # Chunking changes the attention's float sums (a different split of the keys), so
    # each chunking is compared with the resident model prefilled in the same chunks.
    # 3 slots: far fewer than a prompt needs (every chunk reads); 12: a cold start fills up.
    steps = ("64", "100") if arch == "qwen3_moe" else ("64",)
    caches = ("3", "12") if arch == "qwen3_moe" else ("3",)
    for step in steps:
        chunks = ("--prefill-step-size", step)  # int16 prompts: resident experts alike
        expected = _outputs(prepared, tmp_path / f"resident-{step}", *chunks)
        assert all(len(text) > 0 for text, _ in expected.values())
        assert expected[0] != expected[1]
        for cache in caches:
            got = _outputs(
                prepared, tmp_path / f"experts-{cache}-{step}", "--expert-cache", cache, *chunks
            )
            assert got == expected, (cache, step)
        if step == "64":
            got = _outputs(
                prepared, tmp_path / "one-core", "--expert-cache", "3", *chunks, cpus=one_core
            )
            assert got == expected, "one core"


def test_every_expert_path_matches_resident(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill computes an expert as one op (compute.fused_glu), or through mlx-lm's
    SwitchGLU two experts at a time on two MLX streams (compute.expert_streams) or one
    at a time (as before issue 46): every path gives the resident model's tokens."""
    from flashserve.engine.experts import compute, prefill

    from .test_prefill import _alone, _engine

    source = make_model_dir(tmp_path / "src", "qwen3_moe", overrides=WIDE)
    prepared = prepare(str(source), tmp_path / "prepared", expert_bits=4)
    widths: list[int] = []
    fused: list[bool] = []
    real_streams, real_fused = prefill.expert_streams, prefill.fused_glu

    def watched_streams() -> list:
        streams = real_streams()
        widths.append(len(streams))
        return streams

    def watched_fused(*args: object) -> object:
        op = real_fused(*args)
        fused.append(op is not None)
        return op

    monkeypatch.setattr(prefill, "expert_streams", watched_streams)
    monkeypatch.setattr(prefill, "fused_glu", watched_fused)
    resident = _engine(prepared, prompt_matmul="float")
    try:
        expected = _alone(resident, PROMPTS, TOKENS)
    finally:
        resident.shutdown()
    assert not widths and not fused  # every expert resident: no expert-major call
    got = {}
    for path in ("fused", "two at a time", "one at a time"):
        compute.set_fused_experts(path == "fused")
        compute.set_concurrent_experts(path == "two at a time")
        engine = _engine(prepared, expert_cache="3", prompt_matmul="float")
        try:
            widths.clear()
            fused.clear()
            got[path] = _alone(engine, PROMPTS, TOKENS)
        finally:
            engine.shutdown()
            compute.set_fused_experts(True)
            compute.set_concurrent_experts(True)
        assert fused and set(fused) == {path == "fused"}
        if path == "fused":
            assert not widths  # one stream: the op spreads each part over the cores
        else:
            # Two streams where the kernel has two threads or more (one per core).
            two = min(2, len(os.sched_getaffinity(0)))
            assert set(widths) == {two if path == "two at a time" else 1}
    assert got["fused"] == got["two at a time"] == got["one at a time"] == expected
    assert len(expected[0]) == TOKENS and expected[0] != expected[1]
