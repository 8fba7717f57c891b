"""Layer files without the biases their scales give (weights/derived.py).

A Q4_0 or Q8_0 GGUF prepares into layer files that hold no affine biases
(they are -2^(bits-1) x the scales); loading rebuilds them. The rebuilt
tensors must be the converter's bit for bit, and the streamed model's greedy
tokens those of the GGUF loaded resident.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step

from flashserve.engine.compute import qmm
from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights import derived
from flashserve.engine.weights.gguf.model import load_gguf
from flashserve.engine.weights.layout import MANIFEST_NAME, read_safetensors_header
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.reader import WeightFileError
from flashserve.engine.weights.synthetic import make_model_dir

from .gguf_writer import export_gguf

TEXT = "The capital of France is Paris. Hello, how are you?"
TYPES = {  # Q4_1 has a real minimum: its biases stay in the file
    "attn_q": T.Q4_0,
    "attn_k": T.Q4_0,
    "attn_v": T.Q8_0,
    "attn_output": T.Q4_1,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q5_0,
    "ffn_down": T.Q8_0,
}


def _floats(kind: type, dtype: type, count: int) -> np.ndarray:
    """Every float16 bit pattern, or `count` random float32 ones and the edges."""
    if dtype == np.float16:
        return np.arange(1 << 16, dtype=np.uint32).astype(kind)
    rng = np.random.default_rng(0)
    edges = np.array([0, 1, 0x7F7FFFFF, 0x7F800000, 0x00800000, 0x7E000000], kind)
    bits = np.concatenate([rng.integers(0, 1 << 32, count, dtype=np.uint64).astype(kind), edges])
    return np.concatenate([bits, bits | kind(0x80000000)])


@pytest.mark.parametrize("times", [-8, -128, -16, 4])
@pytest.mark.parametrize(("dtype", "kind"), [(np.float16, np.uint16), (np.float32, np.uint32)])
def test_the_rule_is_the_float_product(dtype, kind, times):
    # Zeros, subnormals, the top of the range and infinities included: the bit rule
    # or its fallback gives the float product for every value but NaN.
    bits = _floats(kind, dtype, 1 << 20)
    values = bits.view(dtype)
    got = np.empty_like(bits)
    derived.derive_into(bits.view(np.uint8), got.view(np.uint8), np.dtype(dtype).name, times)
    with np.errstate(over="ignore", invalid="ignore"):
        want = (values.astype(np.float64) * times).astype(dtype).view(kind)
    keep = ~np.isnan(values)
    np.testing.assert_array_equal(got[keep], want[keep])


def test_bfloat16_normal_scales_follow_mlx_product():
    scales = mx.random.normal((4096,)).astype(mx.bfloat16)
    biases = scales * -8
    assert derived.derivable(scales, biases, 4) == -8
    assert derived.derivable(scales, biases + 1, 4) is None  # not the rule: kept
    zero = mx.zeros((8,), mx.bfloat16)
    assert derived.derivable(zero, zero * -8, 4) is None  # no numpy bfloat16 fallback


@pytest.fixture(scope="module")
def symmetric_gguf(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("derived")
    src = make_model_dir(
        root / "src",
        "qwen3",
        overrides={"hidden_size": 256, "intermediate_size": 512, "head_dim": 64},
    )
    model, _, config = mlx_lm.load(str(src), return_config=True)
    qtype = lambda name, shape: TYPES.get(name.rsplit(".", 2)[-2], T.F32)  # noqa: E731
    return export_gguf(model, config, src, root / "q.gguf", qtype=qtype), root


def _greedy(model, tokenizer, n: int = 20) -> list[int]:
    ids = mx.array(tokenizer.encode(TEXT))
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    return [int(t) for t, _ in generate_step(ids, model, max_tokens=n, sampler=sampler)]


def test_symmetric_quants_leave_their_biases_out_and_load_bit_for_bit(symmetric_gguf):
    path, root = symmetric_gguf
    out = prepare(str(path), root / "prepared")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    entry = manifest["layers"][0]
    left_out = {d["name"] for d in entry["derived"]}
    linears = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    assert left_out == {
        f"model.layers.0.{'self_attn' if p[0] in 'qkv' else 'mlp'}.{p}.biases" for p in linears
    }  # o_proj (Q4_1) keeps its own
    assert {d["times"] for d in entry["derived"]} == {-8, -16, -128}  # 4, 5 and 8 bits
    _, header = read_safetensors_header(out / entry["file"])
    assert not left_out & set(header)
    assert "model.layers.0.self_attn.o_proj.biases" in header
    assert entry["bytes"] + sum(d["nbytes"] for d in entry["derived"]) <= entry["tensor_bytes"] + (
        len(header) * 256 + 4096
    )

    resident, _, _ = load_gguf(path)  # the converter's arrays, in memory
    want = dict(tree_flatten(resident.parameters()))
    loaded = load(EngineConfig(model=str(out)))  # every layer through the reader
    got = dict(tree_flatten(loaded.model.parameters()))
    assert set(got) == set(want)
    times = {d["name"]: d["times"] for e in manifest["layers"] for d in e["derived"]}
    for name in want:
        a, b = got[name], want[name]
        if name in times:  # held as the multiple of the scales it is (the fast kernel's)
            assert a.ndim == 0 and a.item() == times[name], name
            a = qmm.full_biases(got[name.replace(".biases", ".scales")], a)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert mx.array_equal(a, b).item(), name
    assert any("biases" in n for n in left_out)


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "direct"])
def test_a_streamed_model_rebuilds_them_and_gives_the_resident_tokens(
    symmetric_gguf, direct, tmp_path
):
    path, _ = symmetric_gguf
    out = prepare(str(path), tmp_path / "prepared")
    resident, tokenizer, _ = load_gguf(path)
    want = _greedy(resident, tokenizer)
    streamed = load(EngineConfig(model=str(out), residency="fixed", resident_layers=1))
    streamer = streamed.streamer
    assert streamer is not None and len(streamer.streamed_layers) >= 3
    streamer.drop_prefetched()
    streamer.direct_reads = direct  # O_DIRECT on the CPU by default: both buffer layouts
    assert _greedy(streamed.model, tokenizer) == want
    # what is counted as read is each file's tensors, not the rebuilt biases
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    for e in manifest["layers"]:
        info = streamer.layers[e["index"]]
        read_bytes = e["tensor_bytes"] - sum(d["nbytes"] for d in e["derived"])
        assert read_bytes < e["tensor_bytes"]
        if e["index"] in streamer.streamed_layers:
            assert info.bytes_read > 0 and info.bytes_read % read_bytes == 0, e["index"]


def test_a_version_2_directory_still_loads_and_says_how_to_shrink_it(
    symmetric_gguf, tmp_path, monkeypatch, caplog
):
    # What an older flashserve wrote: every bias in the files, format_version 2.
    path, _ = symmetric_gguf
    with monkeypatch.context() as patch:
        patch.setattr(derived, "derivable", lambda *args: None)
        out = prepare(str(path), tmp_path / "v2")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert not any(e.get("derived") for e in manifest["layers"])
    manifest["format_version"] = 2
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    resident, tokenizer, _ = load_gguf(path)
    with caplog.at_level("INFO", logger="flashserve.engine.streaming.prepared"):
        streamed = load(EngineConfig(model=str(out), residency="fixed", resident_layers=1))
    assert "layout version 2" in caplog.text and "--force" in caplog.text
    assert _greedy(streamed.model, tokenizer) == _greedy(resident, tokenizer)


def test_a_manifest_that_misnames_a_source_is_refused_naming_it(symmetric_gguf, tmp_path):
    path, _ = symmetric_gguf
    out = prepare(str(path), tmp_path / "prepared")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    first = manifest["layers"][0]["derived"][0]
    first["from"] = first["from"].replace("scales", "weight")  # another size
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(WeightFileError, match=first["name"]):
        load(EngineConfig(model=str(out)))


def test_a_manifest_that_names_other_scales_is_refused_naming_it(symmetric_gguf, tmp_path):
    # The same size, another linear's scales: the fast kernel reads a linear's own
    # scales for its biases (compute/qmm.py scaled_biases), so the manifest must name them.
    path, _ = symmetric_gguf
    out = prepare(str(path), tmp_path / "prepared")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    entries = {d["name"]: d for d in manifest["layers"][0]["derived"]}
    up = entries["model.layers.0.mlp.up_proj.biases"]
    up["from"] = "model.layers.0.mlp.gate_proj.scales"  # gate's are the same shape
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(WeightFileError, match=r"up_proj\.biases: its source .* is not its scales"):
        load(EngineConfig(model=str(out)))


def test_fill_gives_a_file_loaded_whole_its_biases_bit_for_bit(symmetric_gguf, tmp_path):
    # What experts/install.py does for an MoE router's copy: mx.load, then fill.
    path, _ = symmetric_gguf
    out = prepare(str(path), tmp_path / "prepared")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    want = dict(tree_flatten(load_gguf(path)[0].parameters()))
    for entry in manifest["layers"]:
        weights = mx.load(str(out / entry["file"]))
        assert not any(d["name"] in weights for d in entry["derived"])
        derived.fill(weights, entry["derived"])
        for d in entry["derived"]:
            got, expected = weights[d["name"]], want[d["name"]]
            assert got.dtype == expected.dtype and got.shape == expected.shape, d["name"]
            assert mx.array_equal(got, expected).item(), d["name"]
