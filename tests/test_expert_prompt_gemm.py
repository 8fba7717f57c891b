"""An offloaded MoE's expert-major prefill on the integer prompt GEMM (issue 57, item 4).

With `prompt_matmul` "int16" (the default) each expert's gate, up and down
projections take its prompt rows on csrc/prompt_qgemm.cpp (experts/prompt_gemm.py).
Its rows must be close to float64's, the same bit for bit whatever else the
call holds (so any chunking, prefix-cache hit or expert cache size gives the
same tokens and logprobs), and "float" must keep the numbers of before: the
resident model's, bit for bit.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.compute import prompt_matmul, qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.experts.compute import fused_glu, projection_names, restore_order
from flashserve.engine.experts.prefill import expert_major
from flashserve.engine.experts.prompt_gemm import integer_glu
from flashserve.engine.generation.requests import (
    DoneEvent,
    ErrorEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from flashserve.engine.generation.worker import Engine
from flashserve.engine.loader import load
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

from .conftest import NO_EOS

# Experts wide enough that all three projections are quantized (the synthetic
# default leaves a 32-wide down_proj in float).
WIDE = {"hidden_size": 256, "intermediate_size": 128, "moe_intermediate_size": 128}
EXPERTS, TOP_K, LAYERS = 8, 2, 4  # engine.synthetic's MoE
PROMPT = [(7 * i) % 250 + 5 for i in range(96)]
NO_EOS_BIAS = {int(k): v for k, v in NO_EOS.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The model quantized as mlx_lm.convert does (4 bits, groups of 64), and its
    experts re-quantized to 8 bits in groups of 32."""
    if qmm.select("auto") != "fast" or not prompt_matmul.integer_available():
        pytest.skip(f"the integer prompt GEMM does not run here: {qmm.unavailable_reason()}")
    root = tmp_path_factory.mktemp("expert-gemm")
    src = make_model_dir(root / "src", "qwen3_moe", overrides=WIDE, quantize_bits=4)
    return {
        "4-bit": prepare(str(src), root / "q4"),
        "8-bit": prepare(str(src), root / "q8", expert_bits=8, group_size=32),
    }


def _load(path: Path, **knobs: object):
    return load(EngineConfig(model=str(path), **knobs))


def _logits(loaded, chunks: list[int]) -> np.ndarray:
    """Every prompt position's logits, the prompt fed to the model in `chunks`."""
    cache = make_prompt_cache(loaded.model)
    tokens = mx.array([PROMPT])
    outs, start = [], 0
    for n in chunks:
        outs.append(loaded.model(tokens[:, start : start + n], cache=cache))
        mx.eval(outs[-1])
        start += n
    assert start == len(PROMPT)
    return np.array(mx.concatenate(outs, axis=1))


# -- one expert-major call --------------------------------------------------------------


def _reference(offload, info, x: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """The call's output in float64 from the dequantized experts (SwiGLU, as the template)."""
    names = projection_names(info)
    out = np.zeros((*flat.shape, x.shape[-1]))
    for e in np.unique(flat):
        tensors = offload.store.read(info.layer, int(e))
        w = {}
        for proj, keys in names.items():
            m = getattr(info.template, proj)
            dense = mx.dequantize(
                tensors[keys["weight"]],
                tensors[keys["scales"]].astype(mx.float32),
                tensors[keys["biases"]].astype(mx.float32),
                group_size=m.group_size,
                bits=m.bits,
            )
            w[proj] = np.array(dense).astype(np.float64)
        rows, cols = np.nonzero(flat == e)
        xe = x[rows].astype(np.float64)
        gate, up = xe @ w["gate_proj"].T, xe @ w["up_proj"].T
        out[rows, cols] = (gate / (1 + np.exp(-gate)) * up) @ w["down_proj"].T
    return out


@pytest.mark.parametrize("variant", ["4-bit", "8-bit"])
def test_expert_rows_are_near_float64_and_their_own(models, variant) -> None:
    loaded = _load(models[variant], expert_cache="3")
    offload = loaded.experts
    assert offload.prompt_xbits == 16
    info = offload.layers[offload.order[0]]
    bits = {getattr(info.template, p).bits for p in ("gate_proj", "up_proj", "down_proj")}
    assert bits == {int(variant[0])}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((80, WIDE["hidden_size"])).astype(np.float32)
    flat = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(len(x))])

    def call(rows: slice, xbits: int) -> np.ndarray:
        part = flat[rows]
        outs, positions = expert_major(
            info,
            mx.array(x[rows]),
            part,
            np.unique(part),
            cache=offload.cache,
            store=offload.store,
            stats=offload.stats,
            window=4,
            xbits=xbits,
        )
        return np.array(restore_order(outs, positions, part.shape))

    whole = call(slice(None), 16)
    want = _reference(offload, info, x, flat)
    scale = np.abs(want).max()
    error = np.abs(whole - want).max() / scale
    float_error = np.abs(call(slice(None), 0) - want).max() / scale
    assert not np.array_equal(whole, call(slice(None), 0))  # the integer GEMM ran
    # 16-bit rows were 5e-5 of the largest output here (float 5e-7, 8-bit rows 1e-2).
    assert error < 2e-4, (error, float_error)
    # A row's numbers are its own: the same in calls of other sizes, with other
    # experts cached (the first call left some in the cache) or read.
    split = np.concatenate([call(slice(0, 23), 16), call(slice(23, None), 16)])
    assert np.array_equal(split, whole)
    assert np.array_equal(call(slice(50, 51), 16), whole[50:51])
    offload.close()


def test_tokens_run_as_decode_keep_the_float_rows(models) -> None:
    """In a call merged from several parts (a layer-major round's chunks), the tokens of
    a part that the dense linears run as decode (one token) take the float op; the
    others the integer GEMM: each row as it is in a call of its own part alone."""
    loaded = _load(models["4-bit"], expert_cache="100")
    offload = loaded.experts
    info = offload.layers[offload.order[0]]
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((40, WIDE["hidden_size"])).astype(np.float32))
    as_decode = np.zeros(40, dtype=bool)
    as_decode[[3, 17, 18, 39]] = True
    tensors = offload.store.read(info.layer, 5)
    float_op = fused_glu(info, x)
    assert float_op is not None
    mixed = integer_glu(info, x, 16, as_decode, float_op)
    integer = integer_glu(info, x, 16)
    assert mixed is not None and integer is not None
    rows = np.arange(0, 40, 1)
    got = np.array(mixed(x, rows, tensors))
    assert np.array_equal(got[as_decode], np.array(float_op(x, rows[as_decode], tensors)))
    assert np.array_equal(got[~as_decode], np.array(integer(x, rows[~as_decode], tensors)))
    assert integer_glu(info, x, 16, True, float_op) is None  # every token as decode
    assert integer_glu(info, x, 0) is None  # "float"
    offload.close()


# -- whole prompts ------------------------------------------------------------------


def test_every_chunking_and_cache_size_gives_the_same_logits(models) -> None:
    """Prompt logits on the int16 path: bit-identical at every chunking and expert cache
    size (experts read, cached, or every one cached on stacked slabs), near float's."""
    chunkings = ([96], [48, 48], [32, 32, 32], [20, 76])
    small = _load(models["4-bit"], expert_cache="3")
    want = _logits(small, chunkings[0])
    for chunks in chunkings[1:]:
        assert np.array_equal(_logits(small, chunks), want), chunks
    every = _load(models["4-bit"], expert_cache=str(EXPERTS * LAYERS))
    first = _logits(every, [48, 48])  # reads every expert: the layers become slabs
    assert all(info.slab is not None for info in every.experts.layers.values())
    assert np.array_equal(first, want)
    assert np.array_equal(_logits(every, [32, 32, 32]), want)  # on the slabs' experts
    floats = _logits(_load(models["4-bit"], expert_cache="3", prompt_matmul="float"), [96])
    assert not np.array_equal(floats, want)
    assert np.abs(floats - want).max() < 1e-3 * np.abs(floats).max()
    for loaded in (small, every):
        loaded.experts.close()


def _answers(
    path: Path, prompts: list[list[int]], hits: list[int] | None = None, **knobs: object
) -> list[tuple]:
    """Greedy tokens and their logprobs, each prompt after the one before (the prompt
    cache, where on, serves the shared prefix: `hits` gets each prompt's cached tokens)."""
    engine = Engine(EngineConfig(model=str(path), **knobs))
    engine.start()
    assert engine.wait_ready(120), engine.load_error

    async def one(prompt: list[int]) -> tuple:
        handle = engine.submit(
            GenerationRequest(
                prompt_tokens=prompt,
                max_tokens=10,
                sampling=SamplingParams(temperature=0.0, logit_bias=NO_EOS_BIAS),
                logprobs=0,
            )
        )
        tokens, logprobs = [], []
        async for event in handle:
            if isinstance(event, TokenEvent):
                tokens.append(event.token)
                logprobs.append(event.logprob)
            elif isinstance(event, DoneEvent) and hits is not None:
                hits.append(event.cached_tokens)
            elif isinstance(event, ErrorEvent):
                raise AssertionError(event.message)
        return tokens, logprobs

    try:
        return [asyncio.run(one(p)) for p in prompts]
    finally:
        engine.shutdown()


def test_greedy_output_is_the_same_at_every_cache_size_chunking_and_prefix_hit(models) -> None:
    """Through the engine (layer-major prefill: every chunk's expert rows in one call,
    the last prompt token's a chunk of its own that runs as decode): all experts
    cached, a few cached, another chunk size, chunk by chunk, the second prompt's
    prefix from the prompt cache or computed: the same tokens and logprobs on int16."""
    long = [(11 * i + 3) % 250 + 5 for i in range(150)]
    prompts = [long, long[:120] + PROMPT[:40]]
    path = models["4-bit"]
    want = _answers(path, prompts, expert_cache="3", prefill_step_size=64)
    assert want[0][0] != want[1][0]
    runs = {
        "every expert cached": {"expert_cache": str(EXPERTS * LAYERS), "prefill_step_size": 64},
        "chunks of 100": {"expert_cache": "3", "prefill_step_size": 100},
        "chunk by chunk": {
            "expert_cache": "3",
            "prefill_step_size": 64,
            "prefill_order": "chunked",
        },
        "prefix cached": {
            "expert_cache": "5",
            "prefill_step_size": 64,
            "prompt_cache_bytes": 1 << 28,
        },
    }
    for name, knobs in runs.items():
        hits: list[int] = []
        assert _answers(path, prompts, hits, **knobs) == want, name
        if name == "prefix cached":
            assert hits[0] == 0 and hits[1] > 0, hits


def test_float_keeps_the_resident_models_numbers(models) -> None:
    """`prompt_matmul` "float": the offloaded prefill as before, the resident model's
    logits bit for bit at any cache size; set_prompt_matmul switches a loaded model."""
    path = models["4-bit"]
    resident = _logits(_load(path, prompt_matmul="float"), [48, 48])
    for cache in ("3", str(EXPERTS * LAYERS)):
        loaded = _load(path, expert_cache=cache, prompt_matmul="float")
        assert loaded.experts.prompt_xbits == 0
        assert np.array_equal(_logits(loaded, [48, 48]), resident), cache
        assert np.array_equal(_logits(loaded, [48, 48]), resident), cache  # slabs, if all
        loaded.experts.close()
    switched = _load(path, expert_cache="3")
    prompt_matmul.set_prompt_matmul(switched.model, "float")
    assert switched.experts.prompt_xbits == 0
    assert np.array_equal(_logits(switched, [48, 48]), resident)
    prompt_matmul.set_prompt_matmul(switched.model, "int16")
    assert switched.experts.prompt_xbits == 16
    assert not np.array_equal(_logits(switched, [48, 48]), resident)
    switched.experts.close()
    want = _answers(path, [PROMPT], prompt_matmul="float", prefill_step_size=64)
    got = _answers(path, [PROMPT], expert_cache="3", prompt_matmul="float", prefill_step_size=64)
    assert got == want


def test_a_resident_moe_gives_the_offloaded_models_int16_numbers(models) -> None:
    """Served resident (no expert cache), the model's prompt chunks run their experts on
    the integer GEMM too (compute/prompt_experts.py): the offloaded model's int16 logits
    bit for bit at any chunking and cache size, and its greedy tokens and logprobs."""
    for variant in ("4-bit", "8-bit"):
        path = models[variant]
        resident = _load(path)
        assert resident.experts is None
        want = _logits(resident, [48, 48])
        assert np.array_equal(_logits(resident, [96]), want), variant
        assert np.array_equal(_logits(resident, [20, 76]), want), variant
        for cache in ("3", str(EXPERTS * LAYERS)):
            offloaded = _load(path, expert_cache=cache)
            assert np.array_equal(_logits(offloaded, [48, 48]), want), (variant, cache)
            offloaded.experts.close()
        floats = _logits(_load(path, prompt_matmul="float"), [48, 48])
        assert not np.array_equal(floats, want)  # the integer path ran
    want = _answers(models["4-bit"], [PROMPT], expert_cache="3", prefill_step_size=64)
    assert _answers(models["4-bit"], [PROMPT], prefill_step_size=64) == want
