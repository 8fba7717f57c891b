"""Random-weight GGUF files written straight as ggml blocks (the bench's cap models).

One tensor at a time, so a model of several GB never sits in memory and no
float32 copy is made: Q4_0 blocks of random nibbles with small float16 scales
(every such block is valid), float32 norms, router and embeddings. The
tokenizer is weights/synthetic.py's byte-level BPE as GGUF gpt2 metadata, so
llama.cpp and flashserve read the same vocabulary. Written with llama.cpp's
`gguf` package (the `test` extra), imported only when a file is written.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from flashserve.engine.weights.synthetic import build_tokenizer

# ~3.0 GB: 16 layers x 64 experts of 2048 x 768 (Q4_0), top-8; the model.
CAP_MOE = {
    "hidden": 2048,
    "layers": 16,
    "experts": 64,
    "top_k": 8,
    "moe_inter": 768,
    "heads": 32,
    "kv_heads": 4,
    "head_dim": 128,
    "context": 4096,
}
QUICK_CAP_MOE = dict(CAP_MOE, hidden=512, layers=4, experts=16, top_k=4, moe_inter=256, heads=8)
# ~0.69 GB: a dense qwen3 of 1.2B parameters in Q4_0 (issue 54's model): 24 layers
# of 2048 wide, an MLP of 6144, 16 query heads and 8 KV heads of 128.
CAP_DENSE = {
    "hidden": 2048,
    "layers": 24,
    "experts": 0,
    "inter": 6144,
    "heads": 16,
    "kv_heads": 8,
    "head_dim": 128,
    "context": 4096,
}
QUICK_CAP_DENSE = dict(CAP_DENSE, hidden=512, layers=4, inter=1536, heads=8, kv_heads=4)
FORMAT = 3  # bumped when the file changes: a cached model of another format is rewritten
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # weights per block, bytes per block (f16 scale + nibbles)


def _q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 blocks for a (rows, cols) matrix: uint8 (rows, cols / 32 * 18).

    Nibbles run 1..15, so weights (nibble - 8) * d are symmetric around zero.
    Uniform 0..15 would give every matrix a mean of -d / 2: a component along
    the all-ones direction that grows layer by layer until every token's hidden
    state points the same way and the router picks the same experts for every
    token (measured: 8 distinct experts of 64 per layer past the first, where a
    trained model routes by token).
    """
    blocks = np.empty((rows * cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    nibbles = rng.integers(1, 16, (len(blocks), Q4_0_BYTES - 2, 2), dtype=np.uint8)
    blocks[:, 2:] = nibbles[..., 0] | (nibbles[..., 1] << 4)
    # |weight| <= 7 d: d ~ 0.02 / 7 keeps the weights near +-0.02, as trained ones are.
    scale = rng.uniform(0.015, 0.025, len(blocks)) / 7
    blocks[:, 0:2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // Q4_0_BLOCK * Q4_0_BYTES)


def tokenizer_metadata(tokenizer_dir: Path) -> dict[str, Any]:
    """A synthetic byte-level BPE tokenizer as GGUF gpt2 tokenizer metadata."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = data["model"]["vocab"]
    specials = {t["id"]: t["content"] for t in data["added_tokens"]}
    tokens = [""] * (max([*vocab.values(), *specials]) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    for i, text in specials.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",  # llama.cpp's name (it refuses "gpt2")
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if i in specials else 1 for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tokens.index(config["eos_token"]),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": (tokenizer_dir / "chat_template.jinja").read_text(),
    }


def add_metadata(writer: Any, metadata: dict[str, Any]) -> None:
    """Key-value pairs into a `gguf.GGUFWriter`, typed the way llama.cpp reads them."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def write_gguf(path: Path, shape: dict[str, int], seed: int = 0) -> Path:
    """Write a random GGUF of `shape` to `path`: qwen3moe (CAP_MOE), or a dense
    qwen3 when the shape has no experts (CAP_DENSE)."""
    try:
        import gguf
    except ImportError as exc:
        raise RuntimeError(
            "the cap bench writes its model with llama.cpp's gguf package: "
            "pip install 'flashserve[test]' (or pass --model)"
        ) from exc
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    f32 = gguf.GGMLQuantizationType.F32
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = build_tokenizer(Path(tmp))
        tokenizer = tokenizer_metadata(Path(tmp))
    h, hd = shape["hidden"], shape["head_dim"]
    heads, kv, n = shape["heads"], shape["kv_heads"], shape.get("experts", 0)
    inter = shape["moe_inter"] if n else shape["inter"]
    arch = "qwen3moe" if n else "qwen3"
    writer = gguf.GGUFWriter(str(path), arch)
    metadata: dict[str, Any] = {
        f"{arch}.block_count": shape["layers"],
        f"{arch}.context_length": shape["context"],
        f"{arch}.embedding_length": h,
        f"{arch}.feed_forward_length": 4 * h if n else inter,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv,
        f"{arch}.attention.key_length": hd,
        f"{arch}.attention.value_length": hd,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 1000000.0,
        f"{arch}.rope.dimension_count": hd,
        **tokenizer,
    }
    if n:
        metadata[f"{arch}.expert_count"] = n
        metadata[f"{arch}.expert_used_count"] = shape["top_k"]
        metadata[f"{arch}.expert_feed_forward_length"] = inter
    add_metadata(writer, metadata)

    # (name, element shape (numpy order), ggml type, maker of its data)
    plan: list[tuple[str, tuple[int, ...], Any, Any]] = []

    def norm(name: str, size: int) -> None:
        plan.append(
            (name, (size,), f32, lambda: (1 + 0.02 * rng.standard_normal(size)).astype(np.float32))
        )

    def matrix(name: str, rows: int, cols: int, experts: int = 0) -> None:
        dims = (experts, rows, cols) if experts else (rows, cols)
        make = lambda: _q4_0(rng, max(experts, 1) * rows, cols)  # noqa: E731
        plan.append((name, dims, q4_0, make))

    # Embeddings of unit scale: each layer adds an output of RMS ~0.3 to the
    # residual stream, much of it common to every token (random attention
    # averages the context); embeddings as small as the other weights drown in
    # it after a layer, and the router then sees one direction for every token.
    plan.append(
        (
            "token_embd.weight",
            (vocab, h),
            f32,
            lambda: rng.standard_normal((vocab, h)).astype(np.float32),
        )
    )
    for i in range(shape["layers"]):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight", h)
        matrix(f"{b}.attn_q.weight", heads * hd, h)
        matrix(f"{b}.attn_k.weight", kv * hd, h)
        matrix(f"{b}.attn_v.weight", kv * hd, h)
        matrix(f"{b}.attn_output.weight", h, heads * hd)
        norm(f"{b}.attn_q_norm.weight", hd)
        norm(f"{b}.attn_k_norm.weight", hd)
        norm(f"{b}.ffn_norm.weight", h)
        if not n:
            matrix(f"{b}.ffn_gate.weight", inter, h)
            matrix(f"{b}.ffn_up.weight", inter, h)
            matrix(f"{b}.ffn_down.weight", h, inter)
            continue
        plan.append(
            (
                f"{b}.ffn_gate_inp.weight",
                (n, h),
                f32,
                lambda: (0.02 * rng.standard_normal((n, h))).astype(np.float32),
            )
        )
        matrix(f"{b}.ffn_gate_exps.weight", inter, h, n)
        matrix(f"{b}.ffn_up_exps.weight", inter, h, n)
        matrix(f"{b}.ffn_down_exps.weight", h, inter, n)
    norm("output_norm.weight", h)
    plan.append(
        (
            "output.weight",
            (vocab, h),
            f32,
            lambda: (0.02 * rng.standard_normal((vocab, h))).astype(np.float32),
        )
    )

    for name, dims, kind, _ in plan:
        if kind == f32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:  # the writer takes a quantized tensor's shape in bytes
            row = dims[-1] // Q4_0_BLOCK * Q4_0_BYTES
            size = int(np.prod(dims[:-1])) * row
            writer.add_tensor_info(name, (*dims[:-1], row), np.dtype(np.uint8), size, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, _, make in plan:
        writer.write_tensor_data(make())
    writer.close()
    return path
