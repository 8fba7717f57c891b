"""Images in: the vision side of vision-language models (imports config, weights).

mlx-vlm (the optional `vision` extra) gives the vision tower, the projector
and the image processor; the language model stays the mlx-lm model the rest
of the engine runs (streaming, prompt cache, batching, kv_bits), fed the
image's embeddings in place of its placeholder tokens.

- `images.py`   an image's bytes decoded, checked, downscaled, hashed
- `prompt.py`   the image's tokens in a prompt: its placeholder text, and the
                first token of each image made an id that carries its hash
                (the prompt cache's key tells two images apart)
- `tower.py`    VisionModel: the tower, projector and processor of a model
                directory; each image's features cached by its hash
- `qwen.py`     Qwen's images: grid, tower (and deepstack), M-RoPE positions
- `mrope.py`    those positions through mlx-lm's language model (the caches'
                offsets carry them; the batch's carry each sequence's delta),
                and Qwen3-VL's deepstack rows after its first layers
- `embed.py`    a prompt chunk's input embeddings, image features merged in
- `synthetic.py` tiny random vision-language models (tests, bench)
"""
