"""KV cache quantization (the `kv_bits` setting). Imports config and compute.

- `cache`  attention KV stored quantized (mlx-lm's affine quantization): one
           sequence's cache (mlx-lm's QuantizedKVCache made batchable) and the
           batch's (left-padded like mlx-lm's BatchKVCache); `install` makes
           a loaded model hand them out instead of float caches.
- `price`  what one sequence's caches hold per token of a context (plain
           layers at kv_bits, sliding windows at most their window, in float):
           the KV the memory plans reserve.
"""

# What mx.quantize takes that is worth serving: the settings check them
# before MLX is imported (compute/blas.py), so they live here, not in cache.py.
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
