"""How MLX computes on this machine. Imports nothing else of flashserve.

- `device`         the `device` setting: MLX's default device (auto, cpu, gpu),
                   set once as a model loads.
- `blas`           which BLAS serves MLX's float matmuls on Linux (MKL or the
                   bundled reference); must be chosen before MLX is imported.
- `prompt_matmul`  quantized linears take prompt chunks as dequantize + BLAS
                   (large weights: flashserve's kernel, no float copy).
- `qmm`            quantized matmuls with few rows on flashserve's CPU kernel
                   (csrc/, the compiled `_qmm`), MLX's kernel where it cannot run.
- `step_ops`      RMSNorm, RoPE, decode attention, SwiGLU and log-sum-exp as
                   one CPU op each (the same extension) while the fast path is on.
- `heap`           glibc's mmap threshold: fixed under the memory plan, raised
                   while a lent prefill runs.
- `half_scales`    quantized embeddings with float16 scales give float32 rows
                   (a GGUF's exact float16 scales under float32 compute).
"""
