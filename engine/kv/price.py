"""What one sequence's attention caches hold: the KV a memory plan reserves.

Each cache of the model's layout (mlx-lm's make_prompt_cache) is priced as
it holds tokens:

- a plain attention layer (KVCache) keeps every token, at `kv_bits` when set
  (cache.py quantizes these layers only);
- a sliding window (RotatingKVCache) keeps at most its window, in float,
  plus the tokens of a prefill chunk while one runs (mlx-lm keeps
  window - 1 + chunk so that each new token sees a whole window); a chunked
  attention layer (ChunkedKVCache) keeps at most its chunk the same way;
- other attention caches keep every token in float; recurrent state
  (ArraysCache) has a constant size and is not priced per token.

A value is 4 bytes (float32, the CPU's compute dtype: the larger); a
quantized one is its bits plus a float32 scale and bias per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

FLOAT_BYTES = 4


@dataclass(frozen=True)
class KVPrice:
    """Bytes per token of each kind of layer, and the tokens a bounded one keeps."""

    unbounded: int  # layers that keep every token
    bounded: tuple[tuple[int, int], ...] = ()  # (bytes per token, tokens kept at most)

    def bytes(self, tokens: int, chunk: int = 1) -> int:
        """Bytes held with `tokens` in the context, prefilled `chunk` tokens at a time:
        a layer that keeps every token grows by whole steps of KVCache.step tokens."""
        extra = max(chunk, 1) - 1
        held = -(-tokens // KVCache.step) * KVCache.step
        return held * self.unbounded + sum(
            per * min(tokens, most + extra) for per, most in self.bounded
        )


def _config_value(config: dict, key: str, default: Any = None) -> Any:
    text = config.get("text_config") or {}
    return config.get(key, text.get(key, default))


def kv_price(
    model: nn.Module, config: dict, kv_bits: int | None = None, kv_group_size: int = 64
) -> KVPrice:
    """The price of `model`'s caches, from its cache layout and its config's heads."""
    heads = int(_config_value(config, "num_attention_heads", 1) or 1)
    kv_heads = int(_config_value(config, "num_key_value_heads", heads) or heads)
    head_dim = (
        _config_value(config, "head_dim") or int(_config_value(config, "hidden_size", 0)) // heads
    )
    values = 2 * kv_heads * int(head_dim)  # keys and values, per layer and token
    full = values * FLOAT_BYTES
    quantized = full if kv_bits is None else values * kv_bits // 8 + values // kv_group_size * 8
    try:
        caches = make_prompt_cache(model)
    except Exception:  # a model whose cache needs more than its config
        return KVPrice(int(_config_value(config, "num_hidden_layers", 0)) * quantized)
    unbounded, bounded = 0, []
    stack = list(caches)
    while stack:
        cache = stack.pop()
        if isinstance(cache, CacheList):
            stack.extend(cache.caches)
        elif type(cache) is KVCache or isinstance(cache, QuantizedKVCache):
            unbounded += quantized
        elif isinstance(cache, RotatingKVCache):
            bounded.append((full, int(cache.max_size)))
        elif isinstance(cache, ChunkedKVCache):
            bounded.append((full, int(cache.chunk_size)))
        elif "KVCache" in type(cache).__name__:
            unbounded += full
    return KVPrice(unbounded, tuple(bounded))


def kv_bytes_per_token(
    model: nn.Module,
    config: dict,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    tokens: int | None = None,
    chunk: int = 1,
) -> int:
    """KV cache bytes per token of a context of `tokens` (rounded up): what a reserve
    of that many tokens multiplies by. Bounded layers hold less per token as the
    context outgrows them; `tokens` None: a context within every window (every
    layer holds every token). `chunk`: the prefill's chunk size."""
    price = kv_price(model, config, kv_bits, kv_group_size)
    if tokens is None:
        return price.unbounded + sum(per for per, _ in price.bounded)
    tokens = max(int(tokens), 1)
    return -(-price.bytes(tokens, chunk) // tokens)
