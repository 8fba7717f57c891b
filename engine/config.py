"""Engine configuration: what the worker, loader, streaming and expert cache need.

The server builds this from its settings object (config.toml < env < CLI);
the engine never reads configuration on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    model: str | None = None  # None: the bundled default model
    model_id: str | None = None  # name reported by /v1/models; default: derived from path
    # auto: the GPU where this MLX build has one, else the CPU (compute/device.py).
    # Activations: float16 on a GPU, float32 on the CPU (weights/model.py).
    device: str = "auto"  # auto | cpu | gpu
    # Layer streaming (prepared models only; see engine/weights/prepare.py)
    resident_layers: int | None = None  # None with residency="all": keep every layer
    memory_budget: int | None = None  # bytes; alternative to resident_layers
    residency: str = "all"  # all | fixed | auto
    residency_mode: str = "balanced"  # max_tps | balanced | max_context (auto only)
    placement: str = "auto"  # auto | first_n | last_n | interleaved
    prefetch_depth: int = 2  # 2: the read queue never drains between layers (bench io)
    shed_floor: int = 300 * 1024 * 1024  # bytes of available memory before shedding
    # MoE expert offload
    expert_cache: str | None = None  # slots ("2048") or bytes ("3GB"); None: experts resident
    expert_policy: str = "lru"  # lru | lfu
    expert_threads: int = 8
    expert_prefetch: str = "auto"  # auto | none | next-layer (auto: the memory plan decides)
    record_routing: str | None = None  # path of a routing trace to write
    # Generation
    max_batch: int = 8
    prefill_step_size: int = 512
    # auto: layer-major prefill (generation/prefill/layer_major.py) when some weights come
    # from disk; chunked: always mlx-lm's chunk-by-chunk prefill.
    prefill_order: str = "auto"
    prefill_group_bytes: int = 512 * 10**6  # activations a layer-major prefill may hold
    # A layer-major prefill keeps a layer's float weight copies for all its chunks
    # (compute/prompt_matmul.py keep_dequantized); the dense memory plan may not.
    prefill_keep_float_copies: bool = True
    max_queue: int = 64
    # CPU quantized matmuls with few rows and the step ops: auto (flashserve's
    # where they run, engine/compute/qmm.py, step_ops.py) | fast (required) |
    # mlx (MLX's kernel and ops).
    quantized_matmul: str = "auto"
    # CPU prompt chunks through 4- and 8-bit linears and an offloaded MoE's expert
    # rows (experts/prompt_gemm.py): int16 | int8 (rows rounded
    # to that many bits per block of 32, integer dot products:
    # compute/prompt_matmul.py) | float (dequantize + BLAS, or the few-row kernel).
    prompt_matmul: str = "int16"
    # CPU decode steps (and the LM head, experts, verify passes) through 4- and
    # 8-bit linears: int16 (x rounded per block of 32 as the prompt
    # rows are, integer dot products: csrc/qmm_avx512_int.cpp) | float (x kept
    # in float32). Process-wide, like quantized_matmul.
    decode_matmul: str = "int16"
    # Resident models on the CPU: each decode step as one compiled MLX function
    # (generation/decode_step.py); the same tokens either way.
    compile_decode: bool = True
    # Speculative decoding (engine/speculative/): the draft source; drafted
    # tokens per pass at most (each request's length adapts below it).
    speculative: str = "off"  # off | prompt-lookup | draft | both
    speculative_max_draft: int = 8
    speculative_draft_model: str | None = None  # draft | both: a small model, same vocabulary
    # Attention KV kept quantized (engine/kv/): None = float (as computed), 8 or
    # 4 bits in groups of kv_group_size along each head; the prompt cache
    # stores it at that precision.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # The bits a dense memory plan (residency auto, streaming/denseplan.py) may
    # keep the KV cache at, with kv_bits unset, when the model's layers do not
    # all fit beside a float cache (None: never; the plan writes kv_bits).
    plan_kv_bits: int | None = 8
    # Prompt cache: memory tier bytes, 0 turns the whole cache off; SSD tier
    # bytes, 0 keeps it in memory only. The server's settings turn both on.
    prompt_cache_bytes: int = 0
    prompt_cache_disk_bytes: int = 0
    # Set by the dense memory plan (streaming/denseplan.py) when it gives up the
    # memory tier: states go to the SSD tier only, and no copy of a state is
    # taken at a prompt's end (prompt_prefix_states) to store.
    prompt_cache_disk_only: bool = False
    prompt_prefix_states: bool = True
    prompt_cache_dir: str | None = None  # None: the platform's cache dir / fingerprint
    # Bytes the SSD tier may write in any hour (0: no cap); past it, states stay
    # in memory only, so one busy agent does not wear an SSD out.
    prompt_cache_write_bytes_per_hour: int = 0
    # Seconds a weight read (streamed layer, expert) may stall before the
    # request that needs it fails; hung network storage must not hang the server.
    io_timeout: float = 30.0
    # Split across ranks (engine/distributed/): decoder layers per rank ("10,14");
    # None splits evenly. Only read when this process was launched as a rank.
    layer_split: str | None = None
    # A cap on the context the model serves (a [models.NAME] table's `context`);
    # None: the model's own, or what its memory plan bounds it to.
    context_length: int | None = None
    extra: dict = field(default_factory=dict)
