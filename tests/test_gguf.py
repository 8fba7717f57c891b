"""GGUF loading and import: the bundled SmolLM2 GGUF and tiny GGUF files written here.

The tiny files are real GGUF v3 binaries (header, metadata, ggml-quantized
blocks) written with numpy, so the mixed-type path (Q4_0, Q4_1, Q8_0, F16,
F32 side by side) is checked against a float model built from the same
dequantized values.
"""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.weights.gguf.container import GGUFError
from flashserve.engine.weights.gguf.model import import_gguf, load_gguf
from flashserve.engine.weights.model import ModelLoadError
from flashserve.engine.weights.sources import default_model_path

# --------------------------------------------------------------------------- GGUF writer

GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "IQ4_NL": 20}


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(value: object) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _string(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
    if isinstance(value, list) and all(isinstance(v, float) for v in value):
        return struct.pack("<IIQ", 9, 6, len(value)) + np.asarray(value, np.float32).tobytes()
    if isinstance(value, list):
        return struct.pack("<IIQ", 9, 5, len(value)) + np.asarray(value, np.int32).tobytes()
    raise TypeError(value)


def _nibbles(q: np.ndarray) -> np.ndarray:
    # ggml 4-bit blocks: element j in the low nibble of byte j, element j+16 in its high nibble
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def quantize_block(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray]:
    """ggml bytes of `x` in type `kind`, and the values they decode to."""
    x = np.asarray(x, np.float32)
    if kind == "F32":
        return x.tobytes(), x
    if kind == "F16":
        return x.astype(np.float16).tobytes(), x.astype(np.float16).astype(np.float32)
    if kind == "IQ4_NL":  # only its size matters: the loader must refuse it
        return b"\0" * (18 * (x.size // 32)), x
    blocks = x.reshape(-1, 32)
    n = len(blocks)
    if kind == "Q8_0":
        d = (np.abs(blocks).max(1) / 127).astype(np.float16)
        df = d.astype(np.float32)[:, None]
        q = np.round(blocks / np.where(df == 0, 1, df)).clip(-127, 127).astype(np.int8)
        raw = np.zeros(n, dtype=[("d", "<f2"), ("q", "i1", 32)])
        raw["d"], raw["q"] = d, q
        return raw.tobytes(), (q * df).reshape(x.shape)
    if kind == "Q4_0":
        big = blocks[np.arange(n), np.abs(blocks).argmax(1)]
        d = (big / -8).astype(np.float16)
        df = d.astype(np.float32)[:, None]
        q = np.round(blocks / np.where(df == 0, 1, df) + 8).clip(0, 15).astype(np.uint8)
        raw = np.zeros(n, dtype=[("d", "<f2"), ("q", "u1", 16)])
        raw["d"], raw["q"] = d, _nibbles(q)
        return raw.tobytes(), ((q.astype(np.float32) - 8) * df).reshape(x.shape)
    if kind == "Q4_1":
        lo, hi = blocks.min(1), blocks.max(1)
        d, m = ((hi - lo) / 15).astype(np.float16), lo.astype(np.float16)
        df, mf = d.astype(np.float32)[:, None], m.astype(np.float32)[:, None]
        q = np.round((blocks - mf) / np.where(df == 0, 1, df)).clip(0, 15).astype(np.uint8)
        raw = np.zeros(n, dtype=[("d", "<f2"), ("m", "<f2"), ("q", "u1", 16)])
        raw["d"], raw["m"], raw["q"] = d, m, _nibbles(q)
        return raw.tobytes(), (q * df + mf).reshape(x.shape)
    raise ValueError(kind)


def write_gguf(
    path: Path, metadata: dict, tensors: list[tuple[str, np.ndarray, str]]
) -> dict[str, np.ndarray]:
    """Write a GGUF v3 file; returns each tensor's dequantized values."""
    decoded, infos, data, offset = {}, [], [], 0
    for name, array, kind in tensors:
        raw, decoded[name] = quantize_block(array, kind)
        pad = -offset % 32
        offset += pad
        data.append(b"\0" * pad + raw)
        # ggml lists dimensions fastest first
        dims = b"".join(struct.pack("<Q", d) for d in array.shape[::-1])
        infos.append(
            _string(name)
            + struct.pack("<I", array.ndim)
            + dims
            + struct.pack("<IQ", GGML_TYPES[kind], offset)
        )
        offset += len(raw)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    header += b"".join(_string(k) + _value(v) for k, v in metadata.items()) + b"".join(infos)
    header += b"\0" * (-len(header) % 32)
    path.write_bytes(header + b"".join(data))
    return decoded


# --------------------------------------------------------------------------- tiny models

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 2, 1, 2
CONTROL = ["<|im_start|>", "<|im_end|>"]


def _byte_level_chars() -> list[str]:
    # GPT-2's printable stand-ins for the 256 byte values
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def gpt2_vocab() -> dict:
    tokens = CONTROL + _byte_level_chars() + ["he", "ll", "hell", "Ġw"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "Ġ w"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
        ),
    }


def spm_vocab() -> dict:
    # fmt: off
    pieces = [
        "▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁w", "or", "ld", "hell", "▁wor",
        "▁hell", "▁hello", "▁world",
    ]
    # fmt: on
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [*pieces, "<|im_start|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


LAYER_KINDS = [
    # one layer with every type side by side, one plain 4-bit layer
    {
        "attn_q": "Q4_0",
        "attn_k": "Q4_1",
        "attn_v": "Q8_0",
        "attn_output": "F16",
        "ffn_gate": "Q4_1",
        "ffn_up": "Q8_0",
        "ffn_down": "F32",
    },
    dict.fromkeys(
        ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"], "Q4_0"
    ),
]


def write_tiny_llama(
    path: Path,
    vocab: dict,
    tied: bool = False,
    arch: str = "llama",
    kinds: list[dict] | None = None,
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    head_dim = HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    tensors = [
        ("token_embd.weight", rng.standard_normal((n_vocab, HIDDEN)).astype(np.float32), "Q8_0")
    ]
    for i, layer_kinds in enumerate(kinds or LAYER_KINDS):
        for name, shape in shapes.items():
            w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            tensors.append((f"blk.{i}.{name}.weight", w, layer_kinds[name]))
        for name in ("attn_norm", "ffn_norm"):
            tensors.append(
                (
                    f"blk.{i}.{name}.weight",
                    (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
                    "F32",
                )
            )
    tensors.append(("output_norm.weight", np.ones(HIDDEN, np.float32), "F32"))
    if not tied:
        tensors.append(
            (
                "output.weight",
                (rng.standard_normal((n_vocab, HIDDEN)) * 0.1).astype(np.float32),
                "Q4_1",
            )
        )
    metadata = {
        "general.architecture": arch,
        f"{arch}.block_count": len(kinds or LAYER_KINDS),
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": head_dim,
        **vocab,
    }
    return write_gguf(path, metadata, tensors)


def reference_model(config: dict, decoded: dict[str, np.ndarray]):
    """A float32 mlx-lm llama holding the dequantized values as stored, unquantized.

    The q/k rows stay as llama.cpp permuted them and RoPE rotates adjacent
    pairs (traditional): the same model as the loader's un-permuted rows
    under mlx-lm's default RoPE.
    """
    from mlx_lm.models import llama

    from flashserve.engine.weights.gguf.arch import ARCHITECTURES, mlx_name

    args = {k: v for k, v in config.items() if k != "quantization"}
    model = llama.Model(llama.ModelArgs.from_dict({**args, "rope_traditional": True}))
    layers = config["num_hidden_layers"]
    weights = [
        (mlx_name(ARCHITECTURES["llama"], k, layers), mx.array(v)) for k, v in decoded.items()
    ]
    model.load_weights(weights, strict=True)
    return model


def greedy(model, prompt: list[int], n: int, stop: set[int] = frozenset()) -> list[int]:
    tokens = []
    for (token, _), _ in zip(
        generate_step(mx.array(prompt), model, max_tokens=n), range(n), strict=False
    ):
        tokens.append(int(token))
        if tokens[-1] in stop:
            break
    return tokens


# --------------------------------------------------------------------------- the bundled model


@pytest.fixture(scope="module")
def smollm():
    return load_gguf(default_model_path())


def chat_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_default_model_tokenizer_and_template(smollm):
    _, tokenizer, config = smollm
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        in text
    )
    assert tokenizer.decode(tokenizer.encode("Hello, world! 123")) == "Hello, world! 123"
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    assert 2 in tokenizer.eos_token_ids  # <|im_end|>
    # llama.cpp's q/k permutation is undone: mlx-lm's default RoPE, as in the HF checkpoint
    assert "rope_traditional" not in config and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192 and config["model_type"] == "llama"


def test_default_model_mixed_bit_widths(smollm):
    # This Q4_1 file keeps its token embedding in Q8_0: 8-bit beside 4-bit layers.
    model, _, config = smollm
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    assert model.model.embed_tokens.bits == 8
    assert model.model.layers[0].self_attn.q_proj.bits == 4
    assert model.model.layers[29].mlp.down_proj.bits == 4
    if mx.default_device() == mx.cpu:
        # Q8_0/Q4_1 scales are exact in float16, the file's own precision; floats compute in 32
        assert model.model.embed_tokens.scales.dtype == mx.float16
        assert model.model.layers[0].input_layernorm.weight.dtype == mx.float32


def test_default_model_answers_paris(smollm):
    model, tokenizer, _ = smollm
    tokens = greedy(model, chat_prompt(tokenizer), 30, stop=tokenizer.eos_token_ids)
    assert tokens[-1] in tokenizer.eos_token_ids  # a short answer, then <|im_end|>
    detok = tokenizer.detokenizer
    detok.reset()
    for token in tokens[:-1]:
        detok.add_token(token)
    detok.finalize()
    assert "Paris" in detok.text


def test_import_gguf_matches_direct_load(smollm, tmp_path):
    import mlx_lm

    model, tokenizer, _ = smollm
    out = import_gguf(default_model_path(), tmp_path / "smollm")
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (out / name).is_file(), name
    imported, imported_tokenizer = mlx_lm.load(str(out))
    prompt = chat_prompt(tokenizer)
    assert chat_prompt(imported_tokenizer) == prompt
    assert imported.model.embed_tokens.bits == 8
    expected = greedy(model, prompt, 16)
    assert greedy(imported, prompt, 16) == expected


# --------------------------------------------------------------------------- tiny GGUF files


def test_mixed_tensor_types_match_dequantized_reference(tmp_path):
    path = tmp_path / "tiny.gguf"
    decoded = write_tiny_llama(path, gpt2_vocab())
    model, tokenizer, config = load_gguf(path)
    layer0 = model.model.layers[0]
    assert (
        layer0.self_attn.q_proj.bits,
        layer0.self_attn.k_proj.bits,
        layer0.self_attn.v_proj.bits,
    ) == (4, 4, 8)
    assert layer0.mlp.up_proj.bits == 8 and model.model.embed_tokens.bits == 8
    # F16 and F32 tensors stay plain Linear layers
    assert not hasattr(layer0.self_attn.o_proj, "bits")
    assert not hasattr(layer0.mlp.down_proj, "bits")
    assert config["quantization"]["model.layers.0.self_attn.o_proj"] is False
    assert config["tie_word_embeddings"] is False and model.lm_head.bits == 4

    tokens = mx.array([[2 + ord(c) for c in "hello!"]])  # byte b has id 2 + b
    got = model(tokens)
    want = reference_model(config, decoded)(tokens)
    assert got.dtype == mx.float32 if mx.default_device() == mx.cpu else True
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-3, rtol=1e-3)
    byte = {c: 2 + ord(c) for c in "olrd"}
    # merges he+ll -> hell, Ġ+w -> Ġw; control tokens stay whole
    expected = [0, 260, byte["o"], 261, byte["o"], byte["r"], byte["l"], byte["d"], 1]
    assert tokenizer.encode("<|im_start|>hello world<|im_end|>") == expected


def test_tied_embeddings_and_import_with_force(tmp_path):
    import mlx_lm

    path = tmp_path / "tied.gguf"
    write_tiny_llama(path, gpt2_vocab(), tied=True)
    model, _, config = load_gguf(path)
    assert config["tie_word_embeddings"] is True and "lm_head" not in model

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    stale = out / "model-00001-of-00002.safetensors"  # an earlier import's shard
    stale.write_bytes(b"junk")
    with pytest.raises(GGUFError, match="not empty"):
        import_gguf(path, out)
    import_gguf(path, out, force=True)
    assert not stale.exists() and (out / "keep.txt").exists()
    imported, _ = mlx_lm.load(str(out))
    prompt = [5, 6, 7, 8]
    assert greedy(imported, prompt, 8) == greedy(model, prompt, 8)


def test_spm_tokenizer(tmp_path):
    path = tmp_path / "spm.gguf"
    write_tiny_llama(path, spm_vocab(), kinds=LAYER_KINDS[1:])
    _, tokenizer, _ = load_gguf(path)
    vocab = spm_vocab()["tokenizer.ggml.tokens"]
    ids = tokenizer.encode("hello world")
    # BOS by default for SentencePiece
    assert [vocab[i] for i in ids] == ["<s>", "▁hello", "▁world"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    ids = tokenizer.encode("hé\n", add_special_tokens=False)  # é and newline fall back to bytes
    assert [vocab[i] for i in ids] == ["▁", "h", "<0xC3>", "<0xA9>", "<0x0A>"]
    assert tokenizer.decode(ids) == "hé\n"
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [len(vocab) - 1]
    assert isinstance(tokenizer.detokenizer, SPMStreamingDetokenizer)
    detok = tokenizer.detokenizer
    detok.reset()
    for token in tokenizer.encode("hello world", add_special_tokens=False):
        detok.add_token(token)
    detok.finalize()
    assert detok.text == "hello world"


# --------------------------------------------------------------------------- bad files


def _one_line_error(path: Path, match: str) -> None:
    with pytest.raises(GGUFError, match=match) as info:
        load_gguf(path)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match=match):  # what the server sees, through the loader
        load(EngineConfig(model=str(path)))


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a model\n" * 50)
    _one_line_error(path, "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _one_line_error(empty, "not a GGUF file")


def test_truncated_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, gpt2_vocab())
    data = path.read_bytes()
    (tmp_path / "cut_data.gguf").write_bytes(data[: len(data) - 1000])
    _one_line_error(tmp_path / "cut_data.gguf", "truncated GGUF: tensor .* ends past the end")
    (tmp_path / "cut_header.gguf").write_bytes(data[:200])
    _one_line_error(tmp_path / "cut_header.gguf", "corrupt or truncated")


def test_unsupported_architecture_and_tensor_type(tmp_path):
    path = tmp_path / "phi.gguf"
    write_tiny_llama(path, gpt2_vocab(), arch="phi2")
    _one_line_error(path, "architecture 'phi2' is not supported")

    path = tmp_path / "iq4.gguf"
    kinds = [dict(LAYER_KINDS[1], ffn_up="IQ4_NL")]
    write_tiny_llama(path, gpt2_vocab(), kinds=kinds)
    _one_line_error(path, "blk.0.ffn_up.weight has type IQ4_NL, which is not supported")

    path = tmp_path / "bert.gguf"
    write_tiny_llama(
        path, dict(gpt2_vocab(), **{"tokenizer.ggml.model": "bert"}), kinds=LAYER_KINDS[1:]
    )
    _one_line_error(path, "tokenizer model 'bert' is not supported")


def test_float16_scales_keep_prompts_and_embeddings_exact(smollm):
    # The file's Q4_1/Q8_0 scales stay float16 (exact); the prompt path the loader
    # installs (dequantize + BLAS) and the embedding must compute with float32 values.
    from mlx import nn

    from flashserve.engine.compute.prompt_matmul import use_blas_for_prompts

    model, tokenizer, _ = smollm
    tokens = mx.array([tokenizer.encode("The capital of France is Paris, of course.")])
    rows = model.model.embed_tokens
    exact = mx.dequantize(
        rows.weight[tokens],
        rows.scales[tokens].astype(mx.float32),
        rows.biases[tokens].astype(mx.float32),
        group_size=32,
        bits=8,
    )
    if mx.default_device() == mx.cpu:  # on a GPU float16 is the compute dtype
        assert mx.array_equal(rows(tokens), exact).item()
    want = np.array(model(tokens))  # MLX's quantized kernel, row by row
    changed = use_blas_for_prompts(model)
    try:
        got = np.array(model(tokens))  # dequantize + BLAS on the CPU
    finally:
        for _, module in model.named_modules():
            if isinstance(module, nn.QuantizedLinear):
                module.__class__ = nn.QuantizedLinear
    assert changed == (210 if mx.default_device() == mx.cpu else 0)
    np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        ("llama-bpe", ["HelloWorld", "Ġ", "123", "4", "Ġfoo", "/bar"]),  # digits in threes
        ("qwen2", ["HelloWorld", "Ġ", "1", "2", "3", "4", "Ġfoo", "/bar"]),  # single digits
        ("tekken", ["Hello", "World", "Ġ", "1", "2", "3", "4", "Ġfoo", "/bar"]),  # case splits
        ("gpt2", ["HelloWorld", "Ġ1234", "Ġfoo", "/", "bar"]),
    ],
)
def test_byte_level_pre_tokenizers(pre, words):
    from flashserve.engine.weights.gguf.tokenizer import _byte_level_pre_tokenizer

    split = _byte_level_pre_tokenizer(pre).pre_tokenize_str("HelloWorld 1234 foo/bar")
    assert [w for w, _ in split] == words
