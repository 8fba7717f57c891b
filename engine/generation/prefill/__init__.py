"""Prompts run outside mlx-lm's chunk-by-chunk prefill, or changed in it.

- `layer_major`  when weights come from disk: every chunk of the prompts
                 through a layer before the next (one read per layer).
- `alone`        a prompt prefilled outside the batch (n > 1, prompt
                 logprobs, images).
- `last_token`   a prompt's last token in its last chunk: the first token's
                 logits out of the prompt's own pass, in every path above and
                 in the batch.
"""
