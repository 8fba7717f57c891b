"""GGUF file -> mlx-lm model + Hugging Face-style tokenizer, and GGUF -> mlx-lm directory.

`mx.load` already parses GGUF: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine
quantization with group size 32 (`name.weight` uint32 + `name.scales` +
`name.biases`), F16/F32 as plain arrays, and other ggml types (K-quants...)
dequantized to float16. This module maps the tensor names onto mlx-lm's
module tree, builds the config, quantizes each module with the bit width its
own tensor was stored with, and turns the tokenizer metadata into a
tokenizer.json that mlx-lm's tokenizer loader (and so its streaming
detokenizers) understands.
"""

from __future__ import annotations

import importlib
import json
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from .loader import ModelLoadError, compute_dtype

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # every quantized ggml type mx.load maps to affine uses 32-element blocks
GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)

# ggml token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

# GGUF per-layer tensor name -> mlx-lm llama module path (inside model.layers.N)
_LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LLAMA_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Pre-tokenizer regexes of byte-level BPE vocabularies, by tokenizer.ggml.pre.
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")
_LLAMA3_PRES = ("llama-bpe", "llama3", "dbrx", "smaug-bpe")
_QWEN2_PRES = ("qwen2",)
_GPT2_PRES = ("gpt2", "default", "gpt-2")


class GGUFError(ModelLoadError, ValueError):
    """A GGUF file this module cannot turn into a model; the message is one line."""


# --------------------------------------------------------------------------- reading


# ggml tensor types by id; mx.load keeps the first group packed (affine, group 32)
# or plain, and dequantizes the second group to float16.
# fmt: off
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
}
NATIVE_TYPES = {0, 1, 2, 3, 8}
DEQUANTIZED_TYPES = {10, 12, 14, 30}  # Q2_K, Q4_K, Q6_K, BF16: become float16

# GGUF metadata value types: struct format of the fixed-size ones
_GGUF_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
# fmt: on
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """Tensor name -> ggml type id, read from the GGUF header (mx.load does not report
    types and silently drops tensors of types it does not know)."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version < 2:
                raise GGUFError(f"{path}: GGUF version {version} is too old (need 2 or newer)")
            pos = 24

            def skip_value(kind: int, pos: int) -> int:
                if kind in _GGUF_SCALARS:
                    return pos + struct.calcsize(_GGUF_SCALARS[kind])
                if kind == _GGUF_STRING:
                    return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
                if kind == _GGUF_ARRAY:
                    inner, count = struct.unpack_from("<IQ", buf, pos)
                    pos += 12
                    if inner in _GGUF_SCALARS:
                        return pos + count * struct.calcsize(_GGUF_SCALARS[inner])
                    for _ in range(count):
                        pos = skip_value(inner, pos)
                    return pos
                raise GGUFError(f"{path}: corrupt GGUF header (metadata value type {kind})")

            for _ in range(n_kv):
                pos = skip_value(_GGUF_STRING, pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                pos = skip_value(kind, pos + 4)
            types = {}
            for _ in range(n_tensors):
                (length,) = struct.unpack_from("<Q", buf, pos)
                name = bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8")
                pos += 8 + length
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                pos += 4 + 8 * n_dims
                (kind,) = struct.unpack_from("<I", buf, pos)
                pos += 4 + 8
                types[name] = kind
        except (struct.error, UnicodeDecodeError, IndexError, RecursionError) as exc:
            raise GGUFError(f"{path}: corrupt or truncated GGUF header") from exc
    return types


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a GGUF file, with one-line errors for bad files."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic {magic!r})")
    types = gguf_tensor_types(path)
    for name, kind in types.items():
        if kind not in NATIVE_TYPES | DEQUANTIZED_TYPES:
            supported = ", ".join(
                GGML_TYPE_NAMES[t] for t in sorted(NATIVE_TYPES | DEQUANTIZED_TYPES)
            )
            raise GGUFError(
                f"{path}: tensor {name} has type {GGML_TYPE_NAMES.get(kind, kind)}, "
                f"which is not supported (supported: {supported})"
            )
    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises RuntimeError/ValueError with its own wording
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GGUFError(f"{path}: cannot read GGUF: {detail}") from exc
    missing = [name for name in types if name not in weights]
    if missing:
        raise GGUFError(f"{path}: MLX could not read tensor {missing[0]}")
    dequantized = [name for name, kind in types.items() if kind in DEQUANTIZED_TYPES]
    if dequantized:
        log.warning(
            "%d GGUF tensors (%s) are not kept packed: MLX dequantizes them to float16",
            len(dequantized),
            ", ".join(sorted({GGML_TYPE_NAMES[types[n]] for n in dequantized})),
        )
    return weights, metadata


def _meta_value(value: Any) -> Any:
    """GGUF metadata as plain Python: mx.load returns scalars and numeric lists as arrays."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _meta(metadata: dict, key: str, default: Any = None) -> Any:
    return _meta_value(metadata[key]) if key in metadata else default


def _require(metadata: dict, key: str) -> Any:
    if key not in metadata:
        raise GGUFError(f"GGUF metadata lacks {key}")
    return _meta_value(metadata[key])


# --------------------------------------------------------------------------- config


def _bits_of(weights: dict[str, mx.array], prefix: str) -> int:
    # weight packs 32/bits values per uint32; scales hold one value per group of 32
    packed_cols = weights[f"{prefix}.weight"].shape[-1]
    groups = weights[f"{prefix}.scales"].shape[-1]
    bits, rem = divmod(packed_cols * 32, groups * GROUP_SIZE)
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise GGUFError(f"tensor {prefix}: cannot infer its quantization bits from its shapes")
    return bits


def _rope_scaling(metadata: dict, arch: str) -> dict | None:
    kind = _meta(metadata, f"{arch}.rope.scaling.type")
    factor = _meta(metadata, f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = _meta(metadata, f"{arch}.rope.scaling.original_context_length")
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise GGUFError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def gguf_config(metadata: dict, weights: dict[str, mx.array]) -> dict:
    """The mlx-lm config.json dict of a GGUF model (llama architecture)."""
    arch = _meta(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    if _meta(metadata, f"{arch}.expert_count", 0):
        raise GGUFError("GGUF llama models with experts (MoE) are not supported")
    if "rope_freqs.weight" in weights:
        # Llama 3.1-style frequency factors live in a tensor mlx-lm's config cannot express.
        raise GGUFError("GGUF rope_freqs (Llama 3.1+ RoPE frequency factors) is not supported")

    hidden = int(_require(metadata, f"{arch}.embedding_length"))
    heads = int(_require(metadata, f"{arch}.attention.head_count"))
    head_dim = int(_meta(metadata, f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(_meta(metadata, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(
            f"GGUF partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    if "token_embd.weight" not in weights:
        raise GGUFError("GGUF file has no token_embd.weight tensor")
    vocab_size = int(_meta(metadata, f"{arch}.vocab_size", weights["token_embd.weight"].shape[0]))
    tied = "output.weight" not in weights

    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_require(metadata, f"{arch}.block_count")),
        "intermediate_size": int(_require(metadata, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(metadata, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_meta(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes q/k rows so that RoPE rotates adjacent
        # pairs; mlx-lm's traditional RoPE does exactly that, so no un-permuting.
        "rope_traditional": True,
        "max_position_embeddings": int(_meta(metadata, f"{arch}.context_length", 4096)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": "blk.0.attn_q.bias" in weights,
        "mlp_bias": "blk.0.ffn_up.bias" in weights,
    }
    scaling = _rope_scaling(metadata, arch)
    if scaling:
        config["rope_scaling"] = scaling
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = _meta(metadata, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    eos_ids = _eos_token_ids(metadata)
    if len(eos_ids) > 1:
        config["eos_token_id"] = eos_ids
    quantization = _quantization(rename_weights(weights, config["num_hidden_layers"]))
    if quantization:
        config["quantization"] = quantization
    return config


def _eos_token_ids(metadata: dict) -> list[int]:
    # llama.cpp stops on EOS and on the end-of-turn / end-of-message tokens.
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _meta(metadata, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _quantization(weights: dict[str, mx.array]) -> dict | None:
    """mlx-lm quantization dict: the most common width as default, per-module overrides."""
    quantized = {name[: -len(".scales")] for name in weights if name.endswith(".scales")}
    if not quantized:
        return None
    bits = {prefix: _bits_of(weights, prefix) for prefix in sorted(quantized)}
    default = Counter(bits.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for prefix, b in bits.items():
        if b != default:
            quantization[prefix] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    # Linear/embedding modules stored unquantized (F16/F32) must stay plain.
    for name, value in weights.items():
        if name.endswith(".weight") and value.ndim == 2:
            prefix = name[: -len(".weight")]
            if prefix not in quantized:
                quantization[prefix] = False
    return quantization


# --------------------------------------------------------------------------- weights


def rename_weights(weights: dict[str, mx.array], num_layers: int) -> dict[str, mx.array]:
    """GGUF tensor names -> mlx-lm llama parameter names; unknown tensors are an error."""
    renamed: dict[str, mx.array] = {}
    for name, value in weights.items():
        base, _, suffix = name.rpartition(".")
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LLAMA_LAYER_NAMES:
            layer = int(parts[1])
            if layer >= num_layers:
                raise GGUFError(f"GGUF tensor {name} is beyond block_count {num_layers}")
            target = f"model.layers.{layer}.{_LLAMA_LAYER_NAMES[parts[2]]}"
        elif base in _LLAMA_GLOBAL_NAMES:
            target = _LLAMA_GLOBAL_NAMES[base]
        else:
            raise GGUFError(f"GGUF tensor {name} has no place in an mlx-lm llama model")
        renamed[f"{target}.{suffix}"] = value
    return renamed


def _cast(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype else v
        for k, v in weights.items()
    }


def build_model(config: dict, weights: dict[str, mx.array]) -> nn.Module:
    """An mlx-lm model for `config`, quantized per module, with `weights` (mlx-lm names) loaded."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    quantization = config.get("quantization")
    if quantization:

        def class_predicate(path: str, layer: nn.Module) -> bool | dict:
            if path in quantization:
                return quantization[path]
            return hasattr(layer, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=class_predicate,
        )
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise GGUFError(f"GGUF tensors do not fit the {config['model_type']} model: {exc}") from exc
    mx.eval(model.parameters())
    return model


# --------------------------------------------------------------------------- tokenizer


def _token_text(tokens: list[str], token_id: int | None) -> str | None:
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    duplicates = 0
    for i, token in enumerate(tokens):
        if token in vocab:
            duplicates += 1
            continue
        vocab[token] = i
    if duplicates:
        log.warning(
            "GGUF vocabulary repeats %d token strings; later copies are unreachable", duplicates
        )
    return vocab


def _byte_level_pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = {
        **dict.fromkeys(_LLAMA3_PRES, _LLAMA3_REGEX),
        **dict.fromkeys(_QWEN2_PRES, _QWEN2_REGEX),
    }.get(pre or "")
    if regex is None:
        if pre not in _GPT2_PRES and pre is not None:
            log.warning("GGUF pre-tokenizer %r is unknown; using the GPT-2 split", pre)
        regex = _GPT2_REGEX
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2_tokenizer(metadata: dict, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models

    merges_raw = _meta(metadata, "tokenizer.ggml.merges")
    if not merges_raw:
        raise GGUFError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tokenizer = Tokenizer(
        models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(_meta(metadata, "tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _spm_merges(
    vocab: dict[str, int], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    # A BPE merge list equivalent to a SentencePiece BPE model: every piece that
    # splits into two known pieces is a merge, ranked by the piece's score.
    ranked = []
    for piece, piece_id in vocab.items():
        if types[piece_id] not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or len(piece) < 2:
            continue
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(metadata: dict, tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _meta(metadata, "tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise GGUFError("GGUF llama (SentencePiece) tokenizer has no usable tokenizer.ggml.scores")
    vocab = _vocab(tokens)
    unk = _token_text(tokens, _meta(metadata, "tokenizer.ggml.unknown_token_id", 0))
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(vocab, scores, types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(_meta(metadata, "tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(steps)
    # The decoder shape mlx-lm recognizes as SentencePiece (SPMStreamingDetokenizer).
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(dec)
    return tokenizer


def tokenizer_files(metadata: dict, context_length: int | None = None) -> dict[str, str]:
    """Texts of tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    from tokenizers import AddedToken, processors

    model_kind = _meta(metadata, "tokenizer.ggml.model")
    tokens = _meta(metadata, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError("GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    types = _meta(metadata, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if model_kind == "gpt2":
        tokenizer = _gpt2_tokenizer(metadata, tokens)
    elif model_kind == "llama":
        tokenizer = _spm_tokenizer(metadata, tokens, types)
    else:
        raise GGUFError(
            f"GGUF tokenizer model {model_kind!r} is not supported (supported: gpt2, llama)"
        )

    # Control tokens must never be split by the BPE, so "<|im_start|>" is one id.
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types)
        if k == TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types)
        if k == TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(specials)
    if user:
        tokenizer.add_tokens(user)

    bos = _token_text(tokens, _meta(metadata, "tokenizer.ggml.bos_token_id"))
    eos = _token_text(tokens, _meta(metadata, "tokenizer.ggml.eos_token_id"))
    unk = _token_text(tokens, _meta(metadata, "tokenizer.ggml.unknown_token_id"))
    pad = _token_text(tokens, _meta(metadata, "tokenizer.ggml.padding_token_id"))
    add_bos = bool(_meta(metadata, "tokenizer.ggml.add_bos_token", model_kind == "llama"))
    add_eos = bool(_meta(metadata, "tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        single = (
            ([f"{bos}:0"] if add_bos and bos else [])
            + ["$A:0"]
            + ([f"{eos}:0"] if add_eos and eos else [])
        )
        pair = (
            single
            + ([f"{bos}:1"] if add_bos and bos else [])
            + ["$B:1"]
            + ([f"{eos}:1"] if add_eos and eos else [])
        )
        special = {
            t: tokens.index(t) for t in (bos if add_bos else None, eos if add_eos else None) if t
        }
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(special.items())
        )

    special_map = {
        k: v
        for k, v in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
        if v
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        **special_map,
    }
    if context_length:
        config["model_max_length"] = int(context_length)
    template = _meta(metadata, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(config, ensure_ascii=False, indent=2),
        "special_tokens_map.json": json.dumps(special_map, ensure_ascii=False, indent=2),
    }


def write_tokenizer(metadata: dict, out_dir: Path, context_length: int | None = None) -> None:
    for name, content in tokenizer_files(metadata, context_length).items():
        (Path(out_dir) / name).write_text(content, encoding="utf-8")


def _load_tokenizer(directory: Path, eos_token_ids: list[int]) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    try:
        return load_tokenizer(Path(directory), eos_token_ids=eos_token_ids or None)
    except Exception as exc:  # transformers raises many kinds; the user needs one line
        raise GGUFError(f"cannot build the tokenizer from GGUF metadata: {exc}") from exc


# --------------------------------------------------------------------------- public API


def _model_and_config(path: Path, dtype: mx.Dtype) -> tuple[nn.Module, dict, dict]:
    weights, metadata = read_gguf(path)
    config = gguf_config(metadata, weights)
    renamed = _cast(rename_weights(weights, config["num_hidden_layers"]), dtype)
    model = build_model(config, renamed)
    return model, config, metadata


def load_gguf(path: Path) -> tuple[nn.Module, Any, dict]:
    """Model, mlx-lm TokenizerWrapper and mlx-lm config dict of a GGUF file."""
    start = time.perf_counter()
    path = Path(path)
    model, config, metadata = _model_and_config(path, compute_dtype())
    # Going through files lets mlx-lm pick the streaming detokenizer and tool
    # parser exactly as it does for an imported directory.
    with tempfile.TemporaryDirectory(prefix="flashserve-gguf-") as tmp:
        write_tokenizer(metadata, Path(tmp), config["max_position_embeddings"])
        tokenizer = _load_tokenizer(Path(tmp), _eos_token_ids(metadata))
    log.info(
        "loaded GGUF %s: %s, %d layers, %s in %.2fs",
        path.name,
        config["model_type"],
        config["num_hidden_layers"],
        _describe_quantization(config.get("quantization")),
        time.perf_counter() - start,
    )
    return model, tokenizer, config


def import_gguf(
    gguf_path: Path, out_dir: Path, force: bool = False, dtype: str | None = None
) -> Path:
    """Write an mlx-lm model directory for a GGUF file; returns out_dir.

    dtype: float type of scales, biases, norms and unquantized weights
    ("float32", "float16", "bfloat16"); None uses what load_gguf uses on this
    device, so `mlx_lm.load(out_dir)` gives the same greedy tokens as the GGUF.
    """
    from mlx_lm.utils import save_config, save_model

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise GGUFError(f"{out_dir}: exists and is not a directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise GGUFError(f"{out_dir}: directory is not empty (use force to write into it)")
    if dtype is None:
        target = compute_dtype()
    elif dtype in ("float32", "float16", "bfloat16"):
        target = getattr(mx, dtype)
    else:
        raise GGUFError(f"dtype {dtype!r} is not one of float32, float16, bfloat16")
    model, config, metadata = _model_and_config(Path(gguf_path), target)
    out_dir.mkdir(parents=True, exist_ok=True)
    # mlx-lm loads every model*.safetensors it finds: stale shards of an earlier
    # import would be mixed in, so they go; other files are overwritten or kept.
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()
    save_model(out_dir, model)
    config = dict(config)
    config["torch_dtype"] = str(target).rpartition(".")[2]
    save_config(config, out_dir / "config.json")
    write_tokenizer(metadata, out_dir, config["max_position_embeddings"])
    log.info("imported %s into %s", Path(gguf_path).name, out_dir)
    return out_dir


def _describe_quantization(quantization: dict | None) -> str:
    if not quantization:
        return "unquantized"
    widths = Counter(v["bits"] for v in quantization.values() if isinstance(v, dict))
    text = f"{quantization['bits']}-bit"
    if widths:
        text += (
            " (+ "
            + ", ".join(
                f"{n} module{'s' if n > 1 else ''} at {b}-bit" for b, n in sorted(widths.items())
            )
            + ")"
        )
    return text


__all__ = [
    "GGUFError",
    "build_model",
    "gguf_config",
    "import_gguf",
    "load_gguf",
    "read_gguf",
    "rename_weights",
    "tokenizer_files",
    "write_tokenizer",
]
