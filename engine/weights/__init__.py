"""Where weights come from and how they lie on disk. Imports no other engine package.

- `model`           LoadedModel, ModelLoadError, the compute dtype.
- `sources`         resolve a model spec; load a plain model (GGUF or mlx-lm).
- `gguf/`           GGUF files (llama.cpp, Ollama) -> mlx-lm models: the container,
                    ggml blocks -> MLX quantization, architectures, tokenizer,
                    `import-gguf` (its own __init__ lists the modules).
- `layout`          the prepared (streaming) layout: file names, manifest,
                    reading and checking it.
- `prepare`         `flashserve prepare`: write that layout from any model.
- `reader`          weight files into memory: parallel pread on daemon threads,
                    CRC32 per chunk as it lands, io_timeout, safetensors views.
- `tokenizer`       the Hugging Face tokenizer inside mlx-lm's wrapper.
- `fingerprint`     a cheap hash of the weights (the prompt cache's SSD tier).
- `synthetic`       tiny random-weight models of real mlx-lm architectures.
"""
