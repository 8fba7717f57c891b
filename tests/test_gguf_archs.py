"""GGUF architectures: tiny GGUF files written with `gguf` from random mlx-lm models.

Each file is what llama.cpp's converter makes of the model (tests/gguf_writer.py:
names, llama's permuted q/k rows, Gemma's shifted norms, stacked experts,
Llama 3 rope_freqs). Loaded back, it must compute the model's logits; with
quantized tensors, the logits of the values `gguf` dequantizes; a qwen3moe
file with quantized experts goes through `prepare` into the expert layout and
serves from the expert cache exactly as it does resident.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx_lm.generate import generate_step

from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.gguf.arch import (
    ARCHITECTURES,
    llama3_factors,
    llama3_scaling,
    mlx_name,
)
from flashserve.engine.weights.gguf.container import GGUFError
from flashserve.engine.weights.gguf.model import import_gguf, load_gguf
from flashserve.engine.weights.layout import read_manifest
from flashserve.engine.weights.synthetic import make_model_dir

from .conftest import REPO, start_server, stop_server
from .gguf_writer import export_gguf

TEXT = "The capital of France is Paris. Hello, how are you?"
ARCHS = {  # synthetic architecture -> mlx-lm model_type of the loaded GGUF
    "llama": "llama",
    "mistral": "llama",  # llama.cpp writes Mistral as a llama GGUF
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gemma3_text": "gemma3_text",
}


def _source(root: Path, arch: str, **overrides):
    src = make_model_dir(root / f"{arch}-src", arch, overrides=overrides or None)
    model, tokenizer, config = mlx_lm.load(str(src), return_config=True)
    return src, model, tokenizer, config


def _logits(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens])))


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_gguf_gives_the_models_logits(tmp_path, arch):
    src, model, tokenizer, config = _source(tmp_path, arch)
    path = export_gguf(model, config, src, tmp_path / f"{arch}.gguf")
    loaded, gguf_tokenizer, gguf_config = load_gguf(path)
    assert gguf_config["model_type"] == ARCHS[arch]
    assert "quantization" not in gguf_config  # F32 tensors stay float
    tokens = tokenizer.encode(TEXT)
    assert gguf_tokenizer.encode(TEXT) == tokens
    messages = [{"role": "user", "content": TEXT}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == chat
    want = _logits(model, tokens)
    np.testing.assert_allclose(_logits(loaded, tokens), want, atol=1e-4)
    imported = mlx_lm.load(str(import_gguf(path, tmp_path / "imported")))[0]
    np.testing.assert_allclose(_logits(imported, tokens), want, atol=1e-4)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    # Three of the eight frequencies between the thresholds, two scaled, three not.
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 32.0,
        "original_max_position_embeddings": 2048,
    }
    src, model, tokenizer, config = _source(tmp_path, "llama", rope_scaling=scaling)
    path = export_gguf(model, config, src, tmp_path / "llama3.gguf")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    loaded, _, gguf_config = load_gguf(path)
    recovered = gguf_config["rope_scaling"]
    assert recovered["rope_type"] == "llama3" and recovered["factor"] == 8.0
    # the file holds no context length for it: Llama 3's 8192, thresholds scaled to match
    assert recovered["original_max_position_embeddings"] == 8192
    assert recovered["high_freq_factor"] / recovered["low_freq_factor"] == pytest.approx(32)
    tokens = tokenizer.encode(TEXT * 4)
    np.testing.assert_allclose(_logits(loaded, tokens), _logits(model, tokens), atol=1e-4)


@pytest.mark.parametrize(
    ("low", "high", "old"), [(1.0, 4.0, 8192), (1.0, 4.0, 64), (2.0, 3.0, 300), (1.0, 1.5, 60)]
)
def test_llama3_fit_reproduces_the_factors(low, high, old):
    # many, one or no frequencies between the thresholds
    scaling = {
        "factor": 16.0,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old,
    }
    factors = llama3_factors(scaling, 10000.0, 16)
    fitted = llama3_scaling(factors, 10000.0, 16, {}, "llama")
    np.testing.assert_allclose(llama3_factors(fitted, 10000.0, 16), factors, rtol=1e-6)
    with pytest.raises(GGUFError, match="rope_freqs does not follow Llama 3"):
        llama3_scaling(factors[::-1].copy(), 10000.0, 16, {}, "llama")


# --------------------------------------------------------------------------- quantized

WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
EXACT_TYPES = {
    "attn_q": T.Q4_K,
    "attn_k": T.Q5_K,
    "attn_v": T.Q3_K,
    "attn_output": T.Q8_0,
    "ffn_gate": T.Q4_0,
    "ffn_up": T.Q5_0,
    "ffn_down": T.Q5_1,
    "token_embd": T.Q4_1,
    "output": T.Q8_0,
}


def _reference(path: Path, config: dict):
    """A float32 mlx-lm model holding what `gguf` dequantizes, q/k rows un-permuted here."""
    from mlx_lm.models import llama

    args = {k: v for k, v in config.items() if k != "quantization"}
    model = llama.Model(llama.ModelArgs.from_dict(args))
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = []
    for tensor in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        base = tensor.name.rsplit(".", 2)[-2]
        if base in heads:
            h = heads[base]
            values = values.reshape(h, -1, 2, values.shape[-1]).swapaxes(1, 2)
            values = values.reshape(-1, values.shape[-1])
        name = mlx_name(ARCHITECTURES["llama"], tensor.name, config["num_hidden_layers"])
        weights.append((name, mx.array(np.ascontiguousarray(values, np.float32))))
    model.load_weights(weights, strict=True)
    return model


@pytest.mark.parametrize("requantized", [False, True], ids=["exact", "q6_k-q2_k"])
def test_quantized_llama_matches_dequantized_values(tmp_path, requantized):
    types = dict(EXACT_TYPES, **({"ffn_down": T.Q6_K, "ffn_gate": T.Q2_K} if requantized else {}))
    src, model, tokenizer, config = _source(tmp_path, "llama", **WIDE)
    path = export_gguf(
        model, config, src, tmp_path / "q.gguf", qtype=lambda n, s: types[n.rsplit(".", 2)[-2]]
    )
    loaded, _, gguf_config = load_gguf(path)
    attention = loaded.model.layers[0].self_attn
    assert (attention.q_proj.bits, attention.k_proj.bits) == (4, 5)  # Q4_K, Q5_K
    assert attention.v_proj.bits == 8  # Q3_K: exact as 8-bit
    tokens = tokenizer.encode(TEXT)
    got, want = _logits(loaded, tokens), _logits(_reference(path, gguf_config), tokens)
    if requantized:
        # 8-bit re-quantization of Q6_K and Q2_K: close, not equal
        error = np.abs(got - want).max() / np.abs(want).max()
        assert 0 < error < 5e-3, error
    else:
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max())


# --------------------------------------------------------------------------- MoE


MOE = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512}
MOE_TYPES = {  # Q4_K_M-like: 4-bit experts, 6-bit down projections
    "ffn_gate_exps": T.Q4_K,
    "ffn_up_exps": T.Q4_K,
    "ffn_down_exps": T.Q6_K,
    "ffn_gate_inp": T.F32,
    "token_embd": T.Q4_0,
    "output": T.Q8_0,
}


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf-moe")
    src, model, _, config = _source(root, "qwen3_moe", **MOE)
    return export_gguf(
        model,
        config,
        src,
        root / "moe.gguf",
        qtype=lambda n, s: MOE_TYPES.get(n.rsplit(".", 2)[-2], T.Q8_0),
    )


def _greedy(loaded, n: int = 24) -> tuple[list[int], mx.array]:
    ids = mx.array(loaded.tokenizer.encode(TEXT))
    out, last = [], None
    sampler = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for token, logprobs in generate_step(ids, loaded.model, max_tokens=n, sampler=sampler):
        out.append(int(token))
        last = logprobs
    return out, last


def test_moe_gguf_prepared_serves_from_the_expert_cache(moe_gguf, tmp_path):
    resident = load(EngineConfig(model=str(moe_gguf)))
    switch = resident.model.layers[0].mlp.switch_mlp
    assert (switch.gate_proj.bits, switch.down_proj.bits) == (4, 8)  # Q4_K, Q6_K -> 8-bit
    want_tokens, want_logprobs = _greedy(resident)

    proc = subprocess.run(
        [sys.executable, "-m", "flashserve.server.cli", "prepare", str(moe_gguf), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO / "tests",
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = read_manifest(tmp_path)
    assert manifest["moe_layers"] == [0, 1, 2, 3]
    switches = manifest["layers"][0]["experts"]["switches"]
    assert switches[0]["num_experts"] == 8 and len(switches[0]["records"]) == 8
    assert manifest["quantization"]["modules"]["model.layers.0.mlp.switch_mlp.up_proj"]["bits"] == 4

    cached = load(EngineConfig(model=str(tmp_path), expert_cache="6"))
    assert cached.experts is not None
    tokens, logprobs = _greedy(cached)
    assert tokens == want_tokens
    # one expert at a time instead of one gathered matmul: float-level differences only
    assert mx.allclose(logprobs, want_logprobs, atol=2e-3).item()
    assert cached.experts.snapshot().since_start.misses > 0  # experts came from disk
    cached.experts.close()


def test_moe_gguf_imports_as_an_mlx_lm_directory(moe_gguf, tmp_path):
    resident = load(EngineConfig(model=str(moe_gguf)))
    out = import_gguf(moe_gguf, tmp_path / "moe")
    imported = load(EngineConfig(model=str(out)))
    assert imported.model.layers[0].mlp.switch_mlp.up_proj.bits == 4
    assert _greedy(imported)[0] == _greedy(resident)[0]


def test_moe_gguf_served_resident_and_from_the_expert_cache_agree(moe_gguf, tmp_path):
    from flashserve.engine.weights.prepare import prepare

    prepared = prepare(str(moe_gguf), tmp_path / "prepared")
    answers = []
    for model, args in ((moe_gguf, ()), (prepared, ("--expert-cache", "6"))):
        server = start_server(model, tmp_path, *args)
        try:
            reply = server.client().chat.completions.create(
                model=server.model_id,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=12,
                temperature=0,
                logit_bias={"2": -100},  # <|im_end|>: a full answer
            )
            answers.append(reply.choices[0].message.content)
        finally:
            stop_server(server)
        assert "Traceback" not in server.log_tail(10**6)
    assert answers[0] and answers[0] == answers[1]
