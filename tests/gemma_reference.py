"""Gemma 3's forward pass in plain numpy, from llama.cpp's own dequantized weights.

A reference that shares nothing with flashserve's loader or mlx-lm's model: the
`gguf` package dequantizes every tensor (its numpy code for each quant type),
and the layer arithmetic follows Hugging Face's Gemma 3 (embeddings times
sqrt(hidden), RMSNorm with llama.cpp's +1 already in the stored weights, q/k
norms, neox RoPE at 10k on sliding layers and the file's base on every sixth,
GELU-tanh gated MLP, sandwich norms, tied head). For a prompt shorter than the
sliding window, sliding and global attention are the same causal attention.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """x: (tokens, heads, head_dim), positions 0.., rotating the two halves (neox)."""
    tokens, _, dim = x.shape
    half = dim // 2
    angles = np.arange(tokens)[:, None] * base ** (-np.arange(half) * 2 / dim)[None]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def next_token_probs(path: Path, ids: list[int]) -> np.ndarray:
    """The next-token distribution after `ids` (BOS included)."""
    from gguf import GGUFReader, quants

    reader = GGUFReader(path)
    meta = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tok")}
    w = {
        t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        for t in reader.tensors
    }
    hidden, layers = meta["gemma3.embedding_length"], meta["gemma3.block_count"]
    heads, kv_heads = meta["gemma3.attention.head_count"], meta["gemma3.attention.head_count_kv"]
    head_dim, eps = (
        meta["gemma3.attention.key_length"],
        meta["gemma3.attention.layer_norm_rms_epsilon"],
    )
    tokens = len(ids)
    x = w["token_embd.weight"][ids] * np.sqrt(hidden)
    mask = np.triu(np.full((tokens, tokens), -np.inf), 1)
    for i in range(layers):
        b = f"blk.{i}."
        h = _rms(x, w[b + "attn_norm.weight"], eps)
        q = (h @ w[b + "attn_q.weight"].T).reshape(tokens, heads, head_dim)
        k = (h @ w[b + "attn_k.weight"].T).reshape(tokens, kv_heads, head_dim)
        v = (h @ w[b + "attn_v.weight"].T).reshape(tokens, kv_heads, head_dim)
        q = _rms(q, w[b + "attn_q_norm.weight"], eps)
        k = _rms(k, w[b + "attn_k_norm.weight"], eps)
        base = meta["gemma3.rope.freq_base"] if (i + 1) % 6 == 0 else 10_000.0
        q, k = _rope(q, base), _rope(k, base)
        k, v = np.repeat(k, heads // kv_heads, 1), np.repeat(v, heads // kv_heads, 1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(head_dim) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", scores, v).reshape(tokens, heads * head_dim)
        out = out @ w[b + "attn_output.weight"].T
        x = x + _rms(out, w[b + "post_attention_norm.weight"], eps)
        h = _rms(x, w[b + "ffn_norm.weight"], eps)
        mlp = _gelu_tanh(h @ w[b + "ffn_gate.weight"].T) * (h @ w[b + "ffn_up.weight"].T)
        x = x + _rms(mlp @ w[b + "ffn_down.weight"].T, w[b + "post_ffw_norm.weight"], eps)
    logits = _rms(x[-1], w["output_norm.weight"], eps) @ w["token_embd.weight"].T
    probs = np.exp(logits - logits.max())
    return probs / probs.sum()
