"""A Hugging Face tokenizer.json rebuilt from a GGUF file's tokenizer metadata.

mlx-lm's tokenizer loader, and so its streaming detokenizers and tool-parser
inference, read the files written here exactly as they read a downloaded
model's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flashserve.engine.weights.gguf.container import GGUFError, meta

# ggml token types (llama.cpp's llama_token_type)
log = logging.getLogger(__name__)

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4

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
# Mistral's tekken (Nemo, Small 3): case-aware words, single digits
_TEKKEN_REGEX = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")
_LLAMA3_PRES = ("llama-bpe", "llama3", "dbrx", "smaug-bpe")
_QWEN2_PRES = ("qwen2",)
_GPT2_PRES = ("gpt2", "default", "gpt-2")


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
        "tekken": _TEKKEN_REGEX,
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

    merges_raw = meta(metadata, "tokenizer.ggml.merges")
    if not merges_raw:
        raise GGUFError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    tokenizer = Tokenizer(
        models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(meta(metadata, "tokenizer.ggml.pre"))
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

    scores = meta(metadata, "tokenizer.ggml.scores")
    if not scores or len(scores) != len(tokens):
        raise GGUFError("GGUF llama (SentencePiece) tokenizer has no usable tokenizer.ggml.scores")
    vocab = _vocab(tokens)
    unk = _token_text(tokens, meta(metadata, "tokenizer.ggml.unknown_token_id", 0))
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(vocab, scores, types),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(meta(metadata, "tokenizer.ggml.add_space_prefix", True))
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

    model_kind = meta(metadata, "tokenizer.ggml.model")
    tokens = meta(metadata, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError("GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    types = meta(metadata, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
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
        for t, k in zip(tokens, types, strict=True)
        if k == TOKEN_CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(specials)
    if user:
        tokenizer.add_tokens(user)

    bos = _token_text(tokens, meta(metadata, "tokenizer.ggml.bos_token_id"))
    eos = _token_text(tokens, meta(metadata, "tokenizer.ggml.eos_token_id"))
    unk = _token_text(tokens, meta(metadata, "tokenizer.ggml.unknown_token_id"))
    pad = _token_text(tokens, meta(metadata, "tokenizer.ggml.padding_token_id"))
    add_bos = bool(meta(metadata, "tokenizer.ggml.add_bos_token", model_kind == "llama"))
    add_eos = bool(meta(metadata, "tokenizer.ggml.add_eos_token", False))
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
    template = meta(metadata, "tokenizer.chat_template")
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


def load_tokenizer(directory: Path, eos_token_ids: list[int]) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    try:
        return load_tokenizer(Path(directory), eos_token_ids=eos_token_ids or None)
    except Exception as exc:  # transformers raises many kinds; the user needs one line
        raise GGUFError(f"cannot build the tokenizer from GGUF metadata: {exc}") from exc
