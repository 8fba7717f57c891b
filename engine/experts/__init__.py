"""MoE experts on SSD behind an expert cache. May import engine.config and engine.weights.

- `store`    per-layer expert files: one contiguous record per expert, pread
             on a thread pool, CRC checks, recycled buffers.
- `cache`    the cache (capacity in slots or bytes) and its policies (LRU,
             LFU, Belady for replay).
- `compute`  the arithmetic of an offloaded call: mlx-lm's SwitchGLU, one
             expert at a time, bit-identical to the resident model.
- `offload`  ExpertOffload: per MoE call, look up, read, prefetch, compute.
- `install`  swap every SwitchGLU of a model for an OffloadedSwitchGLU.
- `stats`    counters behind /cache/stats.
- `trace`    routing traces (`--record-routing`); `replay` runs them against
             policies and sizes.
"""
