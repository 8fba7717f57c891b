"""MoE experts on SSD behind an expert cache. May import engine.config and engine.weights.

- `store`    per-layer expert files: one contiguous record per expert, pread
             on a thread pool (around the page cache where allowed), CRC checks,
             recycled buffers.
- `cache`    the cache (capacity in slots or bytes) and its policies (LRU,
             LFU, Belady for replay).
- `compute`  the arithmetic of an offloaded call: mlx-lm's SwitchGLU, one
             expert at a time (or as one op of flashserve's kernel, the same
             numbers), bit-identical to the resident model.
- `offload`  ExpertOffload: per MoE call, look up, read, compute.
- `prefetch` next-layer prefetch: the next router's guess read early, its bytes
             out of the cache's.
- `prefill`  a prefill's MoE call, expert-major, and the room it borrows.
- `install`  swap every SwitchGLU of a model for an OffloadedSwitchGLU.
- `stats`    counters behind /cache/stats.
- `trace`    routing traces (`--record-routing`); `replay` runs them against
             policies and sizes.
"""
