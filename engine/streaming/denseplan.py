"""The memory plan behind `--residency auto` for a dense model (no expert cache).

A dense model larger than memory streams the layers it cannot keep. Under a
real limit (a cgroup's, or the host's available memory; streaming/memory.py)
every byte the process touches is charged, so the plan starts from that
limit and sets aside everything serving needs before it keeps a layer:

* what is in use already at load (`limit - available`: the interpreter, the
  server, MLX, the non-layer weights);
* room for the file-backed working set: the libraries' code (MLX, the BLAS,
  Python) pages in from disk, and a limit that leaves it no room makes every
  call re-read it (issue 54: 130 GB read in 4.5 minutes, no token). The
  larger of the part of what is mapped now that serving keeps touching and
  FILE_MIN, or the shed floor and its headroom where those are larger;
* the runtime: MLX's buffer pool and the Python heap's growth while serving;
* the prefill's working memory: a chunk's activations (its attention scores
  against the whole planned context), the float copies the prompt matmuls
  make of a layer's quantized weights (compute/prompt_matmul.py), and the
  hidden states a layer-major prefill holds for the whole prompt, so that it
  reads each streamed layer once per prompt;
* KV for the planned context;
* the prompt cache's memory tier, and the state copies it takes at a prompt's
  end (`prompt_prefix_states`);
* the streaming buffers: (prefetch depth + 1) layers, when a layer streams.

What is left holds resident layers, first to last. When layers do not all
fit and the prompt cache has its disk tier, the memory tier goes first: a
resident layer saves its bytes on every token, the memory tier a read of a
state from disk once a turn; then the KV cache's precision (`plan_kv_bits`),
then prefetch depth past one layer ahead (STREAMED_DEPTH). When even every
layer streamed does not fit, the plan gives up, in this order and logging
each step: the prompt cache's memory tier, prefetch depth, the float copies
kept for a whole layer, the prefill chunk (down to MIN_CHUNK), and the planned context (down to
MIN_CONTEXT); then it refuses to start, with the numbers.

Whatever the resident layers leave (less than a layer) widens the context:
the memory-bound context is the largest number of tokens whose KV and
prefill fit, at most the model's own. The server answers a request that
needs more with the context-length error of its dialect, and /v1/models and
/memory report it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from flashserve.engine.config import EngineConfig
from flashserve.engine.streaming.memory import process_file_resident, system_memory
from flashserve.engine.streaming.memplan import (
    FLOOR_FRACTION,
    MemoryPlan,
    enforce,
    mlx_pool_bytes,
)
from flashserve.engine.streaming.residency import MODES, PlanInputs, fmt_bytes
from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)

# The prefetch depth where layers stream: the next layer's read is queued before
# the wait for this one, so the disk always has a layer's reads in flight, and a
# second layer ahead measured no faster (issue 54) while holding a layer's bytes.
STREAMED_DEPTH = 1

MB = 1024 * 1024
# The Python heap's growth while serving (request, tokenizer and HTTP objects):
# measured 40 MB after a turn of the cap bench's MoE; a quarter again as margin.
RUNTIME_BASE = 48 * MB
# The libraries' code serving keeps paging in (MLX, MKL, Python, the server). On
# the 1.2B dense model 46 MB of files are mapped at load and 52-58 MB after a turn
# with room to spare, but much of it is touched once: under a cap that kept only
# 24 MB free, from a cold page cache, it decoded with no major fault, holding 31-32
# MB of mapped files, 22-24 MB of them charged to its group.
FILE_MIN = 32 * MB
FILE_HOT = 0.7  # of what is mapped at load: the part serving keeps touching
# The shed floor under a small limit (memplan's FLOOR_FRACTION of it): not
# memplan's MIN_FLOOR, which is an expert cache's margin. Below a dense plan's
# floor the code's pages are squeezed; what is kept free (above) holds them.
DENSE_MIN_FLOOR = 16 * MB
MIN_CHUNK = 64  # prefill tokens per chunk: smaller costs more than it saves
MIN_CONTEXT = 256  # tokens: less serves no useful request


@dataclass
class DenseShape:
    """What the dense plan needs to know of a model (config + its layers' weights)."""

    layer_bytes: list[int]  # per decoder layer
    kv_bytes_per_token: int  # past every sliding window: what one more token adds at most
    held_bytes_per_token: int  # hidden states a layer-major prefill holds per prompt token
    context_length: int  # the model's own
    # (chunk tokens, context tokens) -> a chunk's activations and the logits
    activations: Callable[[int, int], int]
    float_copy_bytes: int  # a layer's float weight copies held while its chunks run
    float_slice_bytes: int  # the most float weight made at once without keeping them
    # (context tokens, prefill chunk) -> the KV one sequence holds (kv/price.py: a
    # sliding window keeps at most its window); None: context x kv_bytes_per_token
    kv_bytes: Callable[[int, int], int] | None = None
    kv_bits: int | None = None  # the KV precision these prices are for (None: float)
    # bits -> this shape with its KV priced at those bits (None: no other precision)
    requantize: Callable[[int], DenseShape] | None = None

    def kv(self, tokens: int, chunk: int) -> int:
        if self.kv_bytes is not None:
            return self.kv_bytes(tokens, chunk)
        return tokens * self.kv_bytes_per_token


@dataclass
class DenseSettings:
    """What the plan may give up, in the order it gives it up."""

    prompt_cache_bytes: int  # the memory tier (0: states go to disk only, or nowhere)
    prefix_states: bool  # prompt-end state copies for the prompt cache
    prefetch_depth: int
    keep_float_copies: bool  # a layer's float copies kept for all its chunks
    chunk: int  # prefill tokens per chunk
    context: int  # planned tokens of KV
    kv_bits: int | None = None  # the KV cache's precision (None: float)
    plan_kv_bits: int | None = None  # what the plan may quantize a float cache to


@dataclass
class _Reserves:
    free: int  # the shed floor + headroom, or the file-backed working set
    runtime: int
    prefill: int
    kv: int
    prompt: int  # memory tier + prefix state copies
    buffers: int  # streaming buffers when a layer streams

    def fixed(self) -> int:
        return self.free + self.runtime + self.prefill + self.kv + self.prompt


def _reserves(
    shape: DenseShape, s: DenseSettings, *, free: int, runtime: int, streams: bool
) -> _Reserves:
    largest = max(shape.layer_bytes, default=0)
    prefill = (
        shape.activations(s.chunk, s.context)
        + (shape.float_copy_bytes if s.keep_float_copies else shape.float_slice_bytes)
        + s.context * shape.held_bytes_per_token
    )
    kv = shape.kv(s.context, s.chunk)
    return _Reserves(
        free=free,
        runtime=runtime,
        prefill=prefill,
        kv=kv,
        prompt=s.prompt_cache_bytes + (kv if s.prefix_states else 0),
        buffers=(s.prefetch_depth + 1) * largest if streams else 0,
    )


def plan_dense(
    shape: DenseShape,
    settings: DenseSettings,
    *,
    limit: int,
    available: int,
    source: str,
    shed_floor: int,
    file_bytes: int,
    disk_tier: bool,
    resident_layers: int | None = None,
) -> tuple[MemoryPlan, DenseSettings]:
    """Plan `available` (of `limit`) as the module doc says: the plan, and the settings
    it kept or gave up. ModelLoadError when not even every layer streamed with a
    MIN_CONTEXT context fits."""
    s = DenseSettings(**vars(settings))
    s.context = max(MIN_CONTEXT, min(s.context, shape.context_length))
    shapes = {shape.kv_bits: shape}

    def priced() -> DenseShape:  # the shape at the KV precision planned now
        if s.kv_bits not in shapes and shape.requantize is not None:
            shapes[s.kv_bits] = shape.requantize(s.kv_bits)
        return shapes.get(s.kv_bits, shape)

    def quantize_kv(s: DenseSettings, _: bool) -> str:
        bits = s.plan_kv_bits
        if s.kv_bits is not None or not bits or shape.requantize is None:
            return ""
        before = priced().kv(s.context, s.chunk)
        s.kv_bits = bits
        after = priced().kv(s.context, s.chunk)
        if after >= before:  # no layer's cache would shrink (sliding windows only)
            s.kv_bits = None
            return ""
        return (
            f"the KV cache at {bits} bits ({fmt_bytes(before)} -> {fmt_bytes(after)} for "
            f"{s.context} tokens; greedy output is kv_bits {bits}'s, not a float cache's)"
        )

    reasons: list[str] = []
    floor = min(int(shed_floor), max(DENSE_MIN_FLOOR, int(limit * FLOOR_FRACTION)))
    headroom = floor // 2
    files = max(FILE_MIN, int(file_bytes * FILE_HOT))
    free = max(floor + headroom, files)
    reasons.append(
        f"kept free {fmt_bytes(free)}: the larger of the shed floor {fmt_bytes(floor)} + "
        f"headroom {fmt_bytes(headroom)} and the file-backed working set {fmt_bytes(files)} "
        f"(the libraries' code; {fmt_bytes(file_bytes)} mapped at load)"
    )
    mlx_cache = mlx_pool_bytes(limit)
    runtime = RUNTIME_BASE + mlx_cache
    n = len(shape.layer_bytes)

    def reserves(streams: bool) -> _Reserves:
        return _reserves(priced(), s, free=free, runtime=runtime, streams=streams)

    def fits(count: int) -> bool:
        r = reserves(count < n)
        return r.fixed() + r.buffers + sum(shape.layer_bytes[:count]) <= available

    def most() -> int:
        if resident_layers is not None:
            return max(0, min(int(resident_layers), n))
        count = n
        while count > 0 and not fits(count):
            count -= 1
        return count

    steps = [
        ("the prompt cache's memory tier", _drop_memory_tier),
        ("the KV cache's precision", quantize_kv),
        ("prefetch depth", _lower_depth),
        ("float copies kept for a layer's chunks", _drop_float_copies),
        ("the prefill chunk", _halve_chunk),
    ]
    while not fits(0):
        for what, step in steps:
            change = step(s, disk_tier)
            if change:
                reasons.append(f"does not fit with every layer streamed: gave up {what}: {change}")
                break
        else:
            fitted = _fit_context(s, priced(), fits)
            if fitted is None:
                r = reserves(True)
                raise ModelLoadError(
                    f"the memory limit {fmt_bytes(limit)} ({source}) cannot serve this model "
                    f"even with every layer streamed and a {MIN_CONTEXT}-token context: "
                    f"{fmt_bytes(limit - available)} in use at load, free for the file-backed "
                    f"working set {fmt_bytes(r.free)}, runtime {fmt_bytes(r.runtime)}, prefill "
                    f"{fmt_bytes(r.prefill)} ({s.chunk}-token chunks), KV {fmt_bytes(r.kv)}, "
                    f"streaming buffers {fmt_bytes(r.buffers)}: "
                    f"{fmt_bytes(limit - available + r.fixed() + r.buffers)} needed"
                )
            reasons.append(
                f"does not fit with every layer streamed: the planned context shrank to "
                f"{fitted} tokens"
            )
            break
    count = most()
    if count < n and resident_layers is None and s.prompt_cache_bytes > 0 and disk_tier:
        change = _drop_memory_tier(s, disk_tier)
        reasons.append(
            f"layers do not all fit: {change} (a resident layer saves its bytes on every "
            "token; the disk tier keeps the prompt states)"
        )
        count = most()
    if count < n and resident_layers is None and (change := quantize_kv(s, disk_tier)):
        reasons.append(f"layers do not all fit: {change}")
        count = most()
    if count < n and resident_layers is None and s.prefetch_depth > STREAMED_DEPTH:
        s.prefetch_depth = STREAMED_DEPTH
        reasons.append(
            f"layers do not all fit: prefetch depth {STREAMED_DEPTH} (a layer read ahead "
            "holds a layer's bytes, which a resident layer saves on every token; one read "
            "ahead keeps the disk busy while a layer computes)"
        )
        count = most()
    r = reserves(count < n)
    layers = sum(shape.layer_bytes[:count])
    spare = available - r.fixed() - r.buffers - layers
    context = _widen_context(s, priced(), fits, count)
    r = reserves(count < n)
    # Past the model's context, what is left is KV for more sequences at once.
    left = available - r.fixed() - r.buffers - layers
    budget = context + max(0, left) // max(priced().kv_bytes_per_token, 1)
    reasons.append(
        f"{count}/{n} layers resident ({fmt_bytes(layers)}); the memory-bound context is "
        f"{context} tokens (the model's {shape.context_length}), the batch's KV "
        f"{budget} tokens: KV {fmt_bytes(r.kv)}, prefill {fmt_bytes(r.prefill)} "
        f"({s.chunk}-token chunks), spare before widening {fmt_bytes(max(spare, 0))}"
    )
    plan = MemoryPlan(
        limit_bytes=int(limit),
        limit_source=source,
        available_bytes=int(available),
        in_use_bytes=max(0, int(limit) - int(available)),
        shed_floor_bytes=floor,
        headroom_bytes=headroom,
        mlx_cache_limit_bytes=mlx_cache,
        runtime_reserve_bytes=runtime,
        prefill_reserve_bytes=r.prefill,
        kv_reserve_bytes=r.kv,
        kv_reserve_tokens=context,
        prompt_cache_bytes=r.prompt,
        num_layers=n,
        resident_layers=count,
        resident_layer_bytes=layers,
        stream_buffer_bytes=r.buffers,
        expert_cache_bytes=0,
        expert_total_bytes=0,
        reasons=reasons,
        file_reserve_bytes=r.free,
        context_tokens=context,
        kv_budget_tokens=budget,
        prefill_step_size=s.chunk,
        prefetch_depth=s.prefetch_depth,
        kv_bits=s.kv_bits,
    )
    return plan, s


def _drop_memory_tier(s: DenseSettings, disk_tier: bool) -> str:
    if s.prompt_cache_bytes <= 0 and not s.prefix_states:
        return ""
    s.prompt_cache_bytes, s.prefix_states = 0, False
    return (
        "prompt states go to the disk tier only" if disk_tier else "no prompt cache in memory"
    ) + " (no state copies at a prompt's end)"


def _lower_depth(s: DenseSettings, _: bool) -> str:
    if s.prefetch_depth <= 0:
        return ""
    s.prefetch_depth -= 1
    return f"prefetch depth {s.prefetch_depth}"


def _drop_float_copies(s: DenseSettings, _: bool) -> str:
    if not s.keep_float_copies:
        return ""
    s.keep_float_copies = False
    return "each prompt chunk makes its float weights again"


def _halve_chunk(s: DenseSettings, _: bool) -> str:
    if s.chunk <= MIN_CHUNK:
        return ""
    s.chunk = max(MIN_CHUNK, s.chunk // 2)
    return f"{s.chunk}-token chunks"


def _fit_context(s: DenseSettings, shape: DenseShape, fits: Callable[[int], bool]) -> int | None:
    """The largest context from MIN_CONTEXT up to the planned one with every layer
    streamed; None when not even MIN_CONTEXT fits."""
    planned = s.context
    low, high = MIN_CONTEXT, min(planned, shape.context_length)
    s.context = low
    if not fits(0):
        s.context = planned
        return None
    while low < high:  # the largest context that fits
        mid = (low + high + 1) // 2
        s.context = mid
        if fits(0):
            low = mid
        else:
            high = mid - 1
    s.context = low
    return low


def _widen_context(
    s: DenseSettings, shape: DenseShape, fits: Callable[[int], bool], count: int
) -> int:
    """Widen the planned context into what `count` resident layers leave, up to the
    model's; the result is the memory-bound context (also left in `s`)."""
    low = min(s.context, shape.context_length)
    high = shape.context_length
    s.context = high
    if fits(count):
        return high
    while low < high:
        mid = (low + high + 1) // 2
        s.context = mid
        if fits(count):
            low = mid
        else:
            high = mid - 1
    s.context = low
    return low


def apply_dense_plan(config: EngineConfig, shape: DenseShape) -> MemoryPlan:
    """Plan from this process's real limit and write the plan into `config`.

    The numbers replace "auto" in the config the worker reads too (resident
    layers, prefetch depth, prefill chunk, whether float copies are kept, the
    prompt cache's memory tier and state copies, the layer-major prefill's
    hold); then `enforce` (memplan.py) holds the process to it and logs it, with
    each thing it gave up.
    """
    memory = system_memory()
    disk_tier = config.prompt_cache_disk_bytes > 0
    context = MODES.get(config.residency_mode) or shape.context_length
    kv = shape.kv(context, int(config.prefill_step_size))
    tier = min(int(config.prompt_cache_bytes), kv // 2 if disk_tier else kv)
    settings = DenseSettings(
        prompt_cache_bytes=max(0, tier),
        prefix_states=config.prompt_cache_bytes > 0 and config.prompt_prefix_states,
        prefetch_depth=max(0, int(config.prefetch_depth)),
        keep_float_copies=config.prefill_keep_float_copies,
        chunk=max(1, int(config.prefill_step_size)),
        context=context,
        kv_bits=config.kv_bits,
        plan_kv_bits=config.plan_kv_bits,
    )
    plan, kept = plan_dense(
        shape,
        settings,
        limit=memory.total,
        available=memory.available,
        source=memory.limit_source,
        shed_floor=int(config.shed_floor),
        file_bytes=process_file_resident(),
        disk_tier=disk_tier,
        resident_layers=config.resident_layers,
    )
    config.resident_layers = plan.resident_layers
    config.memory_budget = None
    if config.placement == "auto":
        # Resident layers spread between the streamed ones: each read ahead
        # overlaps a layer's compute or two, never a run of them, so the disk
        # does not wait at a token's first layers (issue 54: 1.2B dense model
        # at 0.85x its size, 7.7-8.0 tok/s against first_n's 7.2-7.6).
        config.placement = "interleaved"
    config.shed_floor = plan.shed_floor_bytes
    config.prefetch_depth = kept.prefetch_depth
    config.prefill_step_size = kept.chunk
    config.prefill_keep_float_copies = kept.keep_float_copies
    config.prompt_prefix_states = kept.prefix_states
    if config.prompt_cache_bytes > 0 and kept.prompt_cache_bytes <= 0:
        # Prompt states still go to the disk tier, where there is one.
        config.prompt_cache_disk_only = disk_tier
    config.prompt_cache_bytes = kept.prompt_cache_bytes
    config.kv_bits = kept.kv_bits  # before the model hands out its caches (loader.py)
    # The whole prompt's hidden states in one group: one read of each streamed
    # layer per prompt (generation/prefill/layer_major.py).
    config.prefill_group_bytes = max(
        int(config.prefill_group_bytes), plan.context_tokens * shape.held_bytes_per_token
    )
    return enforce(plan)


def record_in(inputs: PlanInputs, plan: MemoryPlan, mode: str) -> None:
    """Write the dense plan's numbers into the residency plan's inputs (what /memory's
    `plan` shows): the layer count is the memory plan's, not a configured one."""
    inputs.policy = "auto"
    inputs.mode = mode
    inputs.available_bytes = plan.available_bytes
    inputs.available_source = plan.limit_source
    inputs.runtime_reserve_bytes = plan.runtime_reserve_bytes + plan.prefill_reserve_bytes
    inputs.kv_reserve_tokens = plan.kv_reserve_tokens
    inputs.kv_reserve_bytes = plan.kv_reserve_bytes
    inputs.prompt_cache_bytes = plan.prompt_cache_bytes
    inputs.requested_layers = None
