"""flashserve.engine: everything that touches MLX. It never imports flashserve.server.

Subpackages, from the bottom up (each may import those above it in this list,
never those below):

- `config`       EngineConfig, the engine's knobs (a dataclass; no MLX).
- `compute`      how MLX computes on this machine: the BLAS behind float
                 matmuls, dequantize + BLAS for quantized prompt matmuls.
- `kv`           attention KV kept quantized (`kv_bits`): mlx-lm's quantized
                 cache, batchable; installed on a model as it loads.
- `weights`      where weights come from and how they lie on disk: GGUF,
                 mlx-lm directories, the prepared (streaming) layout and
                 `prepare`, tokenizers, synthetic test models.
- `experts`      MoE experts on SSD: store (pread), cache and policies, the
                 offloaded SwitchGLU, stats, routing traces and their replay.
- `streaming`    decoder layers on SSD: the layer streamer, residency planning
                 and shedding, memory probes, disk helpers, loading a prepared
                 directory (which may install the expert cache).
- `vision`       images in: a vision-language model's tower, projector and
                 image processor (mlx-vlm, the `vision` extra), images decoded
                 and hashed, their tokens in the prompt, the embeddings a
                 prompt with images is prefilled from.
- `loader`       a model spec -> LoadedModel, choosing among the above.
- `distributed`  one model split across machines by layer ranges (MLX's
                 distributed engine): each rank's share, rank 0's messages,
                 the followers, the watchdog, `serve --hostfile`.
- `prompt_cache` longest-prefix reuse of prompt states: memory tier, SSD
                 tier (segment files), their write budget.
- `generation`   the worker thread and its requests, events, samplers, stop
                 strings and constrained-decoding processors.
- `models`       several models in one process: the catalog (models_dir,
                 [models.NAME] tables, aliases) and the pool that loads each
                 on demand on its own worker and unloads idle ones.
- `bench`        `flashserve bench` and its sections; imports any of the above.
"""

# Only ever imported as flashserve.engine: a second copy under a bare "engine" name (a
# script run from the repository root) would hold its own engine state and classes.
if __name__ != "flashserve.engine":
    raise ImportError(f"import flashserve.engine, not {__name__} (pip install -e .)")
