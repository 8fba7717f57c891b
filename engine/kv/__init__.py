"""The attention KV cache: kept quantized (the `kv_bits` setting), merged with room.
Imports config and compute.

- `cache`  attention KV stored quantized (mlx-lm's affine quantization): one
           sequence's cache (mlx-lm's QuantizedKVCache made batchable) and the
           batch's (left-padded like mlx-lm's BatchKVCache); `install` makes
           a loaded model hand them out instead of float caches.
- `room`   a restored state merges into the batch with room for its prompt's
           remaining tokens (mlx-lm's KVCache.merge, replaced at import).
- `price`  what one sequence's caches hold per token of a context (plain
           layers at kv_bits, sliding windows at most their window, in float):
           the KV the memory plans reserve.
"""

# What mx.quantize takes that is worth serving: the settings check them
# before MLX is imported (compute/blas.py), so they live here, not in cache.py.
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
