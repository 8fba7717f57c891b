"""Generation: one worker thread owns every MLX call. May import everything in
flashserve.engine but `bench`.

- `worker`       Engine: the request queue, continuous batching on mlx-lm's
                 BatchGenerator, cancellation, stats.
- `decode_step`  a resident model's decode step as one compiled MLX function
                 (what BatchGenerator calls as the model).
- `requests`     GenerationRequest, SamplingParams, the events a request
                 yields, and RequestHandle (thread-safe hand-off to asyncio).
- `sampling`     a per-request sampler and logits processors (mlx-lm's).
- `stops`        stop strings matched on text.
- `constraints`  llguidance grammars as logits processors; forced tokens.
- `prompt_states` which states go into the prompt cache (engine/prompt_cache/)
                 and when.
"""
