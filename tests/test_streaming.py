"""Layer streaming: token-identical output at every residency, bounded memory,
shedding, the memory report, and refusal of damaged prepared directories."""

from __future__ import annotations

import gc
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as mlx_lm_load

from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.streaming.memory import kv_cache_nbytes, memory_report
from flashserve.engine.streaming.prepared import load_prepared
from flashserve.engine.streaming.residency import place
from flashserve.engine.streaming.streamer import StreamedLayer, StreamStats, is_streamed
from flashserve.engine.weights.model import ModelLoadError
from tests.streaming_fixtures import big_llama, default_gguf_prepared, prepared_model, source_model

TOKENS = 32
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]

# (fraction resident, placement, prefetch depth)
CONFIGS = [
    (0.0, "first_n", 0),
    (0.0, "first_n", 1),
    *[
        (0.5, placement, depth)
        for placement in ("first_n", "last_n", "interleaved")
        for depth in (0, 1)
    ],
    (1.0, "first_n", 0),
    (1.0, "first_n", 1),
]


def greedy(model, prompt: list[int], tokens: int = TOKENS, on_token=None):
    """32 greedy tokens and the final step's log-probabilities."""
    out, last = [], None
    cache = make_prompt_cache(model)
    steps = generate_step(
        mx.array(prompt), model, max_tokens=tokens, sampler=make_sampler(0.0), prompt_cache=cache
    )
    for token, logprobs in steps:
        out.append(int(token))
        last = logprobs
        if on_token is not None:
            on_token(len(out))
    mx.eval(last)
    return out, last, cache


def _check_matrix(prepared: Path, ref_tokens, ref_logprobs, num_layers: int, prompt, reuse=False):
    """Every CONFIGS entry: a fresh load, or (reuse) one load re-planned in place."""
    shared = load(EngineConfig(model=str(prepared), resident_layers=0)) if reuse else None
    for fraction, placement, depth in CONFIGS:
        resident = int(num_layers * fraction)
        if shared is None:
            loaded = load(
                EngineConfig(
                    model=str(prepared),
                    resident_layers=resident,
                    placement=placement,
                    prefetch_depth=depth,
                )
            )
        else:
            loaded = shared
            loaded.streamer.apply(place(resident, num_layers, placement))
            loaded.streamer.prefetch_depth = depth
            loaded.streamer.stats = StreamStats()
        streamer = loaded.streamer
        assert len(streamer.resident_layers) == resident
        tokens, logprobs, _ = greedy(loaded.model, prompt)
        label = f"{resident}/{num_layers} resident, {placement}, prefetch {depth}"
        assert tokens == ref_tokens, label
        assert mx.allclose(logprobs, ref_logprobs, atol=1e-4).item(), label
        if resident < num_layers:
            assert streamer.stats.streamed_calls > 0, label
            assert streamer.stats.bytes_read > 0, label
            if depth:
                assert streamer.stats.prefetch_hits > 0, label
            else:
                assert streamer.stats.prefetch_hits == 0, label
        else:
            # Fully resident: the plain mlx-lm modules, nothing wrapped.
            assert not any(isinstance(layer, StreamedLayer) for layer in loaded.model.layers)
            assert streamer.stats.layer_loads == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next"])
def test_streamed_output_matches_resident(tmp_path_factory, arch):
    src = source_model(tmp_path_factory, arch)
    prepared = prepared_model(tmp_path_factory, arch)
    model, _ = mlx_lm_load(str(src))
    ref_tokens, ref_logprobs, _ = greedy(model, PROMPT)
    assert len(ref_tokens) == TOKENS
    _check_matrix(prepared, ref_tokens, ref_logprobs, len(model.layers), PROMPT)


def test_default_gguf_streamed_matches_resident(tmp_path_factory):
    prepared = default_gguf_prepared(tmp_path_factory)
    ref = load(EngineConfig())  # the GGUF itself, fully resident
    prompt = ref.tokenizer.encode("The capital of France is")
    ref_tokens, ref_logprobs, _ = greedy(ref.model, prompt)
    # One load re-planned in place per configuration: this model is slow on the CPU.
    _check_matrix(prepared, ref_tokens, ref_logprobs, len(ref.model.layers), prompt, reuse=True)


def test_streamed_layers_keep_model_attributes(tmp_path_factory):
    prepared = prepared_model(tmp_path_factory, "qwen3_next")
    loaded = load_prepared(prepared, EngineConfig(resident_layers=0))
    model = loaded.model
    layers = model.layers
    assert all(is_streamed(layer) for layer in layers)
    # qwen3_next reads `is_linear` from its layers to build caches and masks.
    assert [layer.is_linear for layer in layers] == [True, False, True, False]
    assert [type(c).__name__ for c in model.make_cache()] == [
        "ArraysCache",
        "KVCache",
        "ArraysCache",
        "KVCache",
    ]
    # Same module objects and parameter names as the plain model; weights are
    # placeholders while the layer is not running.
    names = {n for n, _ in __import__("mlx.utils").utils.tree_flatten(model.parameters())}
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert layers[1].self_attn.q_proj.weight.size == 0
    _, _, cache = greedy(model, PROMPT, tokens=4)
    assert layers[1].self_attn.q_proj.weight.size == 0  # released again after running
    # Recurrent state and KV caches outlived the weights.
    assert cache[0].state[0][0] is not None and cache[1].offset >= len(PROMPT) + 3


def test_peak_memory_at_zero_residency(tmp_path_factory):
    """Peak MLX memory at 0% residency stays under
    non_layer + (prefetch depth + 1) x largest layer + KV + 25%.

    mx.get_peak_memory counts every MLX allocation: weights are read straight
    into MLX buffers (no intermediate copies), so it is the honest measure of
    what streaming holds. RSS would add the interpreter and libraries.
    """
    _, prepared = big_llama(tmp_path_factory)
    manifest = json.loads((prepared / "manifest.json").read_text())
    largest = max(e["tensor_bytes"] for e in manifest["layers"])
    non_layer = manifest["non_layer"]["tensor_bytes"]
    total = non_layer + sum(e["tensor_bytes"] for e in manifest["layers"])
    assert total > 250e6  # large enough to tell
    for depth in (0, 1):
        # Arrays other tests left alive count in MLX's absolute numbers; measure
        # from what was allocated before this model existed.
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        loaded = load_prepared(prepared, EngineConfig(resident_layers=0, prefetch_depth=depth))
        mx.synchronize()
        mx.reset_peak_memory()
        _, _, cache = greedy(loaded.model, PROMPT, tokens=8)
        peak = mx.get_peak_memory() - before
        kv = kv_cache_nbytes(cache)
        bound = (non_layer + (depth + 1) * largest + kv) * 1.25
        assert peak < bound, (
            f"depth {depth}: peak {peak / 1e6:.1f} MB >= bound {bound / 1e6:.1f} MB"
        )
        # And it really streamed: far less than the whole model was ever held.
        assert peak < total / 3
        del loaded, cache
        mx.clear_cache()


def test_shedding_under_pressure_keeps_output(tmp_path_factory):
    src = source_model(tmp_path_factory, "llama")
    prepared = prepared_model(tmp_path_factory, "llama")
    ref_tokens, ref_logprobs, _ = greedy(mlx_lm_load(str(src))[0], PROMPT)

    loaded = load_prepared(prepared, EngineConfig())  # residency "all"
    streamer = loaded.streamer
    assert streamer.resident_layers == [0, 1, 2, 3]
    pressure = {"available": 10**12}
    streamer.residency.probe = lambda: pressure["available"]

    def on_token(count: int) -> None:
        if count in (8, 16):
            pressure["available"] = 1  # under the 300 MB floor
            streamer.check_memory()
            pressure["available"] = 10**12

    tokens, logprobs, _ = greedy(loaded.model, PROMPT, on_token=on_token)
    assert tokens == ref_tokens
    assert mx.allclose(logprobs, ref_logprobs, atol=1e-4).item()
    # 25% of 4 layers, highest index first, twice.
    assert [e.shed_layers for e in streamer.residency.events] == [[3], [2]]
    assert streamer.resident_layers == [0, 1]
    assert streamer.streamed_layers == [2, 3]
    assert is_streamed(loaded.model.layers[3]) and not is_streamed(loaded.model.layers[1])

    # Shedding returns the layer's memory.
    mx.synchronize()
    before = mx.get_active_memory()
    pressure["available"] = 1
    event = streamer.check_memory()
    assert event.shed_layers == [1]
    layer_bytes = streamer.layer_bytes(1)
    assert before - mx.get_active_memory() >= layer_bytes * 0.9

    # The worker's per-token hook checks every 64 tokens only.
    assert streamer.on_tokens(63) is None
    assert streamer.on_tokens(1).shed_layers == [0]
    pressure["available"] = 1
    assert streamer.on_tokens(64) is None  # nothing left to shed: no crash
    assert streamer.resident_layers == []


def test_memory_report(tmp_path_factory):
    prepared = prepared_model(tmp_path_factory, "qwen3_moe")
    loaded = load_prepared(prepared, EngineConfig(resident_layers=2, placement="last_n"))
    _, _, cache = greedy(loaded.model, PROMPT, tokens=4)
    report = memory_report(loaded, prompt_caches=[cache])
    data = json.loads(json.dumps(asdict(report)))  # plain JSON all the way down
    manifest = json.loads((prepared / "manifest.json").read_text())
    layer = manifest["layers"][0]
    per_layer = layer["tensor_bytes"] + layer["experts"]["tensor_bytes"]
    assert data["resident_layers"] == [2, 3]
    assert data["streamed_layers"] == [0, 1]
    assert data["non_layer_bytes"] == manifest["non_layer"]["tensor_bytes"]
    assert data["resident_weight_bytes"] == data["non_layer_bytes"] + 2 * per_layer
    assert data["kv_cache_bytes"] == kv_cache_nbytes(cache) > 0
    assert (
        data["rss_bytes"] > 0 and data["system_total_bytes"] >= data["system_available_bytes"] > 0
    )
    assert data["mlx_active_bytes"] > 0
    assert data["plan"]["resident_layers"] == [2, 3]
    assert data["plan"]["inputs"]["policy"] == "fixed"
    assert data["streaming"]["streamed_calls"] > 0
    assert data["shedding_events"] == []
    assert memory_report(loaded, kv_cache_bytes=123).kv_cache_bytes == 123

    # A plain (not prepared) model reports every layer resident.
    plain = load(EngineConfig(model=str(source_model(tmp_path_factory, "llama"))))
    report = memory_report(plain)
    assert report.resident_layers == [0, 1, 2, 3] and report.streamed_layers == []
    assert report.plan is None and report.resident_weight_bytes > report.non_layer_bytes > 0


def _copy(prepared: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(prepared, out)
    return out


def test_missing_layer_file_is_refused(tmp_path_factory, tmp_path):
    out = _copy(prepared_model(tmp_path_factory, "llama"), tmp_path)
    (out / "layers" / "layer_0002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"layer_0002\.safetensors: missing"):
        load(EngineConfig(model=str(out), resident_layers=0))


def test_truncated_layer_file_is_refused(tmp_path_factory, tmp_path):
    out = _copy(prepared_model(tmp_path_factory, "llama"), tmp_path)
    file = out / "layers" / "layer_0001.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"layer_0001\.safetensors: .*truncated"):
        load(EngineConfig(model=str(out)))


def test_truncated_expert_file_is_refused(tmp_path_factory, tmp_path):
    out = _copy(prepared_model(tmp_path_factory, "qwen3_moe"), tmp_path)
    file = out / "experts" / "layer_0003.safetensors"
    with open(file, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ModelLoadError, match=r"experts/layer_0003\.safetensors"):
        load(EngineConfig(model=str(out), resident_layers=0))


def test_budget_smaller_than_non_layer_is_refused(tmp_path_factory):
    prepared = prepared_model(tmp_path_factory, "llama")
    manifest = json.loads((prepared / "manifest.json").read_text())
    non_layer = manifest["non_layer"]["tensor_bytes"]
    with pytest.raises(
        ModelLoadError, match=rf"smaller than the non-layer weights .*\({non_layer} bytes\)"
    ):
        load(EngineConfig(model=str(prepared), memory_budget=non_layer // 2))
    # Room for 3.5 of the 4 layers: with one streaming buffer (prefetch depth 0)
    # two stay resident.
    layer = max(e["tensor_bytes"] for e in manifest["layers"])
    loaded = load(
        EngineConfig(
            model=str(prepared), memory_budget=non_layer + 7 * layer // 2, prefetch_depth=0
        )
    )
    assert loaded.streamer.resident_layers == [0, 1]
