"""`prepare`: the streaming layout on disk, re-quantization, and refusals."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_model

from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.layout import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PAD_PREFIX,
    read_safetensors_header,
)
from flashserve.engine.weights.model import ModelLoadError
from flashserve.engine.weights.prepare import PrepareError, prepare
from tests.streaming_fixtures import default_gguf_prepared, prepared_model, source_model


def _load(file: Path) -> dict[str, mx.array]:
    """A prepared file's tensors through MLX's own reader, without the alignment padding."""
    return {k: v for k, v in mx.load(str(file)).items() if not k.startswith(PAD_PREFIX)}


def _np_dtype(name: str) -> np.dtype:
    return np.dtype({"bfloat16": "uint16"}.get(name, name))


def test_layout_and_manifest(tmp_path_factory):
    src = source_model(tmp_path_factory, "qwen3_moe")
    out = prepared_model(tmp_path_factory, "qwen3_moe")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["num_layers"] == 4
    assert manifest["moe_layers"] == [0, 1, 2, 3]
    assert manifest["layers_prefix"] == "model.layers."
    assert len(manifest["source"]["hash"]) == 64
    for name in ("config.json", "tokenizer.json", "non_layer.safetensors"):
        assert (out / name).is_file(), name
    assert {p.name for p in (out / "layers").iterdir()} == {
        f"layer_{i:04d}.safetensors" for i in range(4)
    }

    model, _ = mlx_lm_load(str(src))
    params = dict(tree_flatten(model.parameters()))
    # Non-layer and layer files hold exactly the source weights, split by prefix.
    non_layer = _load(out / "non_layer.safetensors")
    assert set(non_layer) == {n for n in params if not n.startswith("model.layers.")}
    layer0 = _load(out / "layers/layer_0000.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in layer0
    assert not any("switch_mlp" in n for n in layer0)  # experts live elsewhere
    assert mx.array_equal(
        layer0["model.layers.0.mlp.gate.weight"], params["model.layers.0.mlp.gate.weight"]
    )
    sizes = sum(e["bytes"] + (e["experts"] or {}).get("bytes", 0) for e in manifest["layers"])
    assert manifest["total_bytes"] == sizes + manifest["non_layer"]["bytes"]

    # One pread per expert returns that expert's tensors, bit for bit.
    experts = manifest["layers"][2]["experts"]
    (switch,) = experts["switches"]
    assert switch["path"] == "model.layers.2.mlp.switch_mlp"
    assert switch["num_experts"] == 8
    assert set(switch["tensors"]) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    fd = os.open(out / experts["file"], os.O_RDONLY)
    try:
        for e in (0, 5, 7):
            offset, length = switch["records"][e]
            assert length == switch["record_bytes"]
            record = os.pread(fd, length, offset)
            for name, t in switch["tensors"].items():
                raw = record[t["offset"] : t["offset"] + t["nbytes"]]
                got = np.frombuffer(raw, _np_dtype(t["dtype"])).reshape(t["shape"])
                want = np.asarray(params[f"{switch['path']}.{name}"][e])
                np.testing.assert_array_equal(got, want)
    finally:
        os.close(fd)
    # Records are back to back, in expert order, and match the safetensors header.
    records = switch["records"]
    assert all(b[0] == a[0] + a[1] for a, b in itertools.pairwise(records))
    start, header = read_safetensors_header(out / experts["file"])
    first = header["model.layers.2.mlp.switch_mlp.0003.down_proj.weight"]["data_offsets"][0]
    assert start + first == records[3][0]
    # The expert file is plain safetensors for any reader (alignment padding aside).
    assert len(_load(out / experts["file"])) == 8 * 3


def test_refuses_non_empty_out_without_force(tmp_path_factory, tmp_path):
    src = source_model(tmp_path_factory, "llama")
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(PrepareError, match="not empty"):
        prepare(str(src), tmp_path)
    assert not (tmp_path / MANIFEST_NAME).exists()
    prepare(str(src), tmp_path, force=True)
    assert (tmp_path / MANIFEST_NAME).is_file()
    assert (tmp_path / "keep.txt").read_text() == "user data"  # force replaces only our files
    # Preparing again over a complete output also needs force.
    with pytest.raises(PrepareError):
        prepare(str(src), tmp_path)


def test_refuses_bad_arguments(tmp_path_factory, tmp_path):
    src = source_model(tmp_path_factory, "llama")
    with pytest.raises(PrepareError, match="bits"):
        prepare(str(src), tmp_path / "a", bits=7)
    with pytest.raises(PrepareError, match="group-size"):
        prepare(str(src), tmp_path / "b", bits=4, group_size=48)
    with pytest.raises(ModelLoadError, match="no such file"):
        prepare(str(tmp_path / "nowhere"), tmp_path / "c")
    with pytest.raises(PrepareError, match="already a prepared"):
        prepare(str(prepared_model(tmp_path_factory, "llama")), tmp_path / "d")


def test_interrupted_prepare_leaves_no_manifest(tmp_path_factory, tmp_path):
    src = source_model(tmp_path_factory, "llama")
    out = tmp_path / "out"

    def crash(done: int, total: int, message: str) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), out, progress=crash)
    assert (out / "layers" / "layer_0000.safetensors").exists()  # it got going
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.glob("*.tmp"))
    with pytest.raises(ModelLoadError):  # does not load as anything
        load(EngineConfig(model=str(out)))
    # An interrupted --force over a complete directory also loses the manifest first.
    complete = tmp_path / "complete"
    prepare(str(src), complete)
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), complete, force=True, progress=crash)
    assert not (complete / MANIFEST_NAME).exists()


def test_progress_reports_every_layer(tmp_path_factory, tmp_path):
    src = source_model(tmp_path_factory, "llama")
    seen = []
    prepare(str(src), tmp_path / "out", progress=lambda d, t, m: seen.append((d, t)))
    assert seen == [(i, 5) for i in range(1, 6)]


def test_requantize_mixed_widths(tmp_path_factory, tmp_path):
    src = source_model(tmp_path_factory, "qwen3_moe")
    out = prepare(str(src), tmp_path / "q", bits=8, expert_bits=4, group_size=32)
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    modules = manifest["quantization"]["modules"]
    assert modules["model.layers.0.mlp.switch_mlp.gate_proj"]["bits"] == 4
    assert modules["model.layers.0.self_attn.q_proj"]["bits"] == 8
    assert modules["model.embed_tokens"]["bits"] == 8
    # The model's own quant_predicate keeps its router at 8 bits, group 64 (as mlx-lm does).
    assert modules["model.layers.1.mlp.gate"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert all(q["group_size"] == 32 for p, q in modules.items() if not p.endswith("mlp.gate"))
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    assert (quant["bits"], quant["group_size"]) == (8, 32)
    assert quant["model.layers.3.mlp.switch_mlp.down_proj"]["bits"] == 4
    # Expert records hold 4-bit packed weights plus scales and biases.
    switch = manifest["layers"][0]["experts"]["switches"][0]
    assert set(switch["tensors"]) >= {"gate_proj.weight", "gate_proj.scales", "gate_proj.biases"}
    assert switch["tensors"]["gate_proj.weight"]["dtype"] == "uint32"

    # config.json alone makes mlx-lm build the same quantized model: merge the
    # prepared files back into one checkpoint and load it strictly.
    merged = tmp_path / "merged"
    merged.mkdir()
    shutil.copy(out / "config.json", merged / "config.json")
    weights = _load(out / "non_layer.safetensors")
    for entry in manifest["layers"]:
        weights.update(_load(out / entry["file"]))
        experts = _load(out / entry["experts"]["file"])
        for sw in entry["experts"]["switches"]:
            for name in sw["tensors"]:
                parts = [experts[f"{sw['path']}.{e:04d}.{name}"] for e in range(sw["num_experts"])]
                weights[f"{sw['path']}.{name}"] = mx.stack(parts)
    mx.save_safetensors(str(merged / "model.safetensors"), weights)
    model, _ = load_model(merged, strict=True)
    assert model.model.layers[0].mlp.switch_mlp.gate_proj.bits == 4
    assert model.model.layers[0].self_attn.q_proj.bits == 8

    # The prepared directory runs the same fully streamed as fully resident,
    # and the same as the merged checkpoint through plain mlx-lm.
    tokens = mx.array([[1, 2, 3, 40, 41]])
    streamed = load(EngineConfig(model=str(out), resident_layers=0)).model(tokens)
    resident = load(EngineConfig(model=str(out))).model(tokens)
    assert streamed.shape == (1, 5, config["vocab_size"])
    assert bool(mx.all(mx.isfinite(streamed)))
    assert mx.array_equal(streamed, resident)
    # Plain mlx-lm computes prompts in float: so does prompt_matmul = "float" (the
    # default int16 rows differ from it by rounding: compute/prompt_matmul.py).
    floats = load(EngineConfig(model=str(out), prompt_matmul="float", decode_matmul="float")).model(
        tokens
    )
    assert mx.allclose(model(tokens), floats, atol=1e-5)


def test_prepare_gguf_writes_tokenizer(tmp_path_factory):
    out = default_gguf_prepared(tmp_path_factory)
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["num_layers"] == config["num_hidden_layers"]
    assert manifest["quantization"]["modules"]  # Q4_1 stays quantized
    loaded = load(EngineConfig(model=str(out), resident_layers=0))
    assert loaded.tokenizer.chat_template
    assert loaded.tokenizer.encode("Hello")
