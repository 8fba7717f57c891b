"""Random-weight models of real mlx-lm architectures, written to disk.

Tests and the benchmark need real model directories (config.json, safetensors,
tokenizer files) without a model hub. The weights are random, everything else
is what `mlx_lm.load` expects from a real checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

log = logging.getLogger(__name__)

# ChatML with Qwen-style tool and reasoning markers, so every tiny model can
# exercise the chat template path the way a real instruct model does.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- if message.tool_calls %}"
    "{%- for tc in message.tool_calls %}"
    '\n<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments if tc.function.arguments is string "
    "else tc.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}"
    "{%- endif %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {**_BASE, "model_type": "llama", "attention_bias": False, "mlp_bias": False},
    # mlx-lm runs "mistral" as llama; llama.cpp writes it as a llama GGUF.
    "mistral": {**_BASE, "model_type": "mistral"},
    "qwen2": {**_BASE, "model_type": "qwen2"},
    "qwen3": {**_BASE, "model_type": "qwen3"},
    # Both attention kinds in four layers: sliding (local RoPE base) and global.
    "gemma3_text": {
        **_BASE,
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": 16,
        "sliding_window": 512,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3_moe": {
        **_BASE,
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {
        **_BASE,
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        **_BASE,
        "model_type": "qwen2_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": False,
    },
    # Hybrid: gated delta-net (recurrent state) layers with full attention
    # every `full_attention_interval` layers, MoE feed-forward.
    "qwen3_next": {
        **_BASE,
        "model_type": "qwen3_next",
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 2,
        "norm_topk_prob": True,
    },
}


def build_tokenizer(
    out: Path,
    *,
    chat_template: str | None = None,
    extra_special_tokens: Sequence[str] = (),
    bos_token: str | None = None,
    eos_token: str = "<|im_end|>",
) -> int:
    """Write a byte-level BPE tokenizer (tokenizer.json + config) to `out`.

    Returns the vocabulary size. Every byte is a token, so any text round-trips;
    a handful of merges make common English pieces single tokens.
    `chat_template` replaces CHATML_TEMPLATE (tests use real models' templates);
    `extra_special_tokens` come after SPECIAL_TOKENS, so existing ids keep
    their values; `bos_token` / `eos_token` name tokens of either list.
    """
    specials = SPECIAL_TOKENS + [t for t in extra_special_tokens if t not in SPECIAL_TOKENS]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
        "Hello, how are you? I am a helpful assistant. What is the weather today?",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    ] * 4
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = chat_template or CHATML_TEMPLATE
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def make_model_dir(
    out: str | Path,
    arch: str = "llama",
    *,
    overrides: dict[str, Any] | None = None,
    quantize_bits: int | None = None,
    group_size: int = 64,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    chat_template: str | None = None,
    extra_special_tokens: Sequence[str] = (),
    bos_token: str | None = None,
    eos_token: str = "<|im_end|>",
) -> Path:
    """Write a random-weight model of `arch` to `out`; return the path.

    `overrides` changes config keys (e.g. hidden_size for a bigger bench model).
    `quantize_bits` quantizes every quantizable layer the way mlx_lm.convert does.
    """
    from mlx_lm.utils import _get_classes, save_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(
        out,
        chat_template=chat_template,
        extra_special_tokens=extra_special_tokens,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    config = dict(ARCHITECTURES[arch])
    config.update(overrides or {})
    config["vocab_size"] = max(config.get("vocab_size", 0), vocab)
    specials = SPECIAL_TOKENS + [t for t in extra_special_tokens if t not in SPECIAL_TOKENS]
    config["eos_token_id"] = specials.index(eos_token)

    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # Default inits leave norms at 1 and some vectors at 0; perturb every
    # parameter so that no layer is an identity and wrong weights show.
    params = tree_map(lambda p: p + 0.02 * mx.random.normal(p.shape), model.parameters())
    model.update(params)
    model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
    if quantize_bits:
        nn.quantize(model, group_size=group_size, bits=quantize_bits)
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    mx.eval(model.parameters())
    if hasattr(model, "sanitize"):
        pass  # weights are already in mlx-lm layout; sanitize is for HF checkpoints
    save_model(out, model, donate_model=True)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    nbytes = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    log.info("wrote %s model to %s (%.1f MB)", arch, out, nbytes / 1e6)
    return out
