"""How MLX computes on this machine. Imports nothing else of flashserve.

- `blas`           which BLAS serves MLX's float matmuls on Linux (MKL or the
                   bundled reference); must be chosen before MLX is imported.
- `prompt_matmul`  quantized linears take prompt chunks as dequantize + BLAS.
"""
