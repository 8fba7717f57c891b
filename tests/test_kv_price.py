"""The KV a memory plan reserves is what the caches really hold (engine/kv/price.py).

A Gemma 3 model has sliding-window layers (mlx-lm's RotatingKVCache: at most
its window, plus a prefill chunk while one runs, and never quantized:
engine/kv/cache.py quantizes plain KVCache layers only) beside global ones
(every token, at kv_bits). The price is checked against the bytes the
caches of a tiny gemma3 hold while a prompt is prefilled chunk by chunk and
decoded, and against what a server's residency plan reserves.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_load

from flashserve.engine.kv import cache as kv_cache
from flashserve.engine.kv.price import kv_price
from flashserve.engine.streaming.prepared import kv_bytes_per_token
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

from .conftest import start_server, stop_server

WINDOW = 64  # the sliding window: far below the contexts priced
CHUNK = 512  # the engine's prefill_step_size
BITS, GROUP = 8, 64


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(
        tmp_path_factory.mktemp("kv-price") / "gemma3",
        "gemma3_text",
        overrides={"head_dim": 64, "sliding_window": WINDOW},
    )


def held_bytes(model_dir: Path, tokens: int, bits: int | None = BITS) -> int:
    """The most one sequence's caches hold at `bits` while `tokens` tokens are
    prefilled in chunks (then one decode step)."""
    model, _ = mlx_load(str(model_dir))
    if bits is not None:
        kv_cache.install(model, bits, GROUP)
    cache = make_prompt_cache(model)
    most = 0
    prompt = [(7 * i) % 200 + 10 for i in range(tokens)]
    for start in range(0, tokens - 1, CHUNK):
        chunk = prompt[start : min(start + CHUNK, tokens - 1)]
        mx.eval(model(mx.array([chunk]), cache=cache))
        most = max(most, sum(c.nbytes for c in cache))
    mx.eval(model(mx.array([prompt[-1:]]), cache=cache))
    return max(most, sum(c.nbytes for c in cache))


@pytest.mark.parametrize("tokens", [512, 2048])
def test_price_is_what_the_caches_hold(gemma_dir: Path, tokens: int) -> None:
    """Within a window's reach (512: the windowed layers hold every token, in float)
    and far past it (2048: they hold a window and a chunk)."""
    model, _ = mlx_load(str(gemma_dir))
    config = json.loads((gemma_dir / "config.json").read_text())
    held = held_bytes(gemma_dir, tokens)
    priced = kv_bytes_per_token(model, config, BITS, GROUP, tokens=tokens, chunk=CHUNK) * tokens
    assert held <= priced <= held * 1.02, (priced, held)


def test_residency_plan_reserves_what_a_context_holds(gemma_dir: Path, tmp_path: Path) -> None:
    """A streamed gemma3 at --kv-bits 8 reserves what the caches hold for the plan's
    context (balanced: 1,024 tokens, past a window and a chunk)."""
    prepared = prepare(str(gemma_dir), tmp_path / "prepared")
    flags = ("--kv-bits", str(BITS), "--residency", "auto", "--residency-mode", "balanced")
    server = start_server(prepared, tmp_path, *flags)
    try:
        inputs = server.http().get("/memory").json()["plan"]["inputs"]
    finally:
        stop_server(server)
    held = held_bytes(gemma_dir, inputs["kv_reserve_tokens"])
    assert held <= inputs["kv_reserve_bytes"] <= held * 1.02, (inputs["kv_reserve_bytes"], held)


@pytest.mark.parametrize("bits", [None, BITS])
def test_a_context_between_cache_steps_is_priced_at_whole_steps(tmp_path: Path, bits) -> None:
    """mlx-lm's caches grow 256 tokens at a time: 700 tokens hold 768 tokens' room, and
    a plan that priced 700 would let a request at its context pass it (issue 54)."""
    model_dir = make_model_dir(tmp_path / "llama", "llama", overrides={"head_dim": 64})
    model, _ = mlx_load(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    price = kv_price(model, config, bits, GROUP)
    held = held_bytes(model_dir, 700, bits)
    assert price.bounded == () and 700 * price.unbounded < held
    assert price.bytes(700, CHUNK) == held == price.bytes(768, CHUNK)
