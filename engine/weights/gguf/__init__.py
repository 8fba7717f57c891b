"""GGUF files (llama.cpp, Ollama) as mlx-lm models. Imports weights/model.py and compute.

- `container`  the file: header, metadata, tensor records over a memory map.
- `quants`     ggml blocks -> MLX affine quantization (group 32), in numpy.
- `arch`       architectures: metadata -> mlx-lm config, tensor names, and the
               tensor fixes llama.cpp's converter made (Q/K permutation, norms).
- `tokenizer`  tokenizer.json rebuilt from the tokenizer metadata.
- `model`      GGUF -> mlx-lm model, tokenizer and config; `import-gguf`.
- `synthetic`  random-weight qwen3moe and dense qwen3 GGUF files written as
               ggml blocks (the bench's cap models); imports weights/synthetic.py.
"""
