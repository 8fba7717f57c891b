"""Prompt tokens through quantized linears on the CPU: dequantize, then a BLAS matmul.

MLX's CPU kernel for quantized matmuls costs the same per row whatever the
number of rows, so a 200-token prompt costs 200 single-token steps.
Dequantizing the weight once and handing the rows to the BLAS (MKL,
engine/compute/blas.py) costs one pass over the weight plus a matmul that
barely grows with rows, so prompts prefill many times faster with MKL, and a
little faster on the reference BLAS (docs/guides/cpu-and-gpu.md; `flashserve
bench --sections prefill`).

Only inputs with two or more tokens per sequence take this path. A decode
step (one token per sequence, whatever the batch size) goes on to the few-row
kernel (compute/qmm.py, or MLX's where that cannot run): faster for few rows,
and a request's decode is numerically the same alone and in a batch. On a GPU
MLX's own kernels are fast; nothing is changed there.

A chunk runs on every core the process may use (compute/cores.py; issue 42:
prefill used one of two): the BLAS on that many threads while the chunk's
layer is evaluated (compute/blas.py), and the
weight dequantized by flashserve's op on the kernel's threads
(csrc/prompt_dequant.cpp) instead of MLX's one-thread mx.dequantize. Both
give the one-thread path's numbers bit for bit (MIN_THREADED_ROWS says
when), so tokens do not change; `set_parallel(False)` is that path.

Weights whose float copy would be 32 MB or more (KERNEL_MIN_FLOAT_BYTES: a
large model's attention and MLP) skip the copy: with flashserve's AVX-512
kernel for their width, their prompt rows go to it as a decode step's do,
measured faster than copy + BLAS there (issue 46). The choice depends on
the weights only, so it is the same for every prompt and chunking.
Elsewhere a layer-major prefill (generation/prefill/layer_major.py) runs a layer's
chunks inside `keep_dequantized`, which makes each float copy once per
layer instead of once per chunk.

Before both, the `prompt_matmul` setting (issue 57): with "int16" (the
default) or "int8", 4- and 8-bit weights (groups of 32, 64, 128) of any size
take csrc/prompt_qgemm.cpp, a GEMM on the quantized data as llama.cpp's:
each prompt row rounded to integers of that many bits in blocks of 32 and
multiplied by the packed weights with integer dot products (AVX-512 VNNI,
AVX-VNNI or AVX2, picked at run time), on every core, no float copy. It
changes the numbers by the rows' rounding: 8 bits moved the default model's
top-5 next-token probabilities by up to 0.2, 16 bits by under 0.001, at
half the integer rate, still far ahead of the float paths
(docs/benchmarks/agent-turns.md). A row's numbers depend on that row alone, so
chunking, caching and batching give the same tokens. "float" keeps the
paths above. An offloaded MoE's prefill takes the setting for its expert
rows too (experts/prompt_gemm.py; set_prompt_matmul reaches it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import mlx.core as mx
import mlx.nn as nn

from flashserve.engine.compute import blas, cores, qmm

# The dequantized float32 weight is made in slices of at most this many bytes,
# so a large matrix (an 8B model's MLP: 235 MB in float32) never needs its
# whole float copy at once.
SLICE_BYTES = 64 * 1024 * 1024

DEQUANT_BITS = (2, 4, 8)  # the widths flashserve's dequantize op unpacks

# Tokens per sequence from which a chunk's BLAS calls run threaded. MKL's
# threaded sgemm gives a row the same numbers as its one-thread sgemm from 12
# rows on, where it takes another path below (measured on every matmul shape
# of the default model and its attention, 1 to 600 rows): so a prompt gets
# the same tokens on any number of cores, prefilled cold or after a cached
# prefix. Chunks of fewer rows are cheap on one thread.
MIN_THREADED_ROWS = 16

# Tokens per sequence from which the integer GEMM's and the kernel's outputs are
# evaluated linear by linear (below): a full chunk (prefill_step_size, 256 or 512)
# holds one linear's activations at a time, as a layer-major prefill under a memory
# limit plans. A shorter chunk (an agent's next turn, a short prompt's tail) holds
# little, and there each evaluation only added a wait for MLX's stream per linear
# (~40 us: 210 a chunk on the default model, a seventh of a 10-token next turn's
# time to first token); left lazy, the chunk's graph runs in one evaluation, as a
# decode step's does. The GEMM, the kernel and attention (csrc/prompt_sdpa.cpp) keep
# their threads either way. Lazy against linear by linear after a 756-token prefix,
# once attention ran on every core in both: the 1.2B bench model 376 against 398 ms
# at 64 rows, 507 / 538 at 92, 683 / 725 at 128, and lazy still ahead at 300; the
# default model 2-4% ahead at 92-200 (docs/benchmarks/agent-turns.md). The
# arithmetic is the same op for op, so the numbers are too.
EVAL_EACH_FROM_ROWS = 128


class _Parallel:
    on = True  # prompt chunks on every core; off: one thread, as before issue 42 (bench, tests)
    threads = 0  # cores.usable(), asked once


_parallel = _Parallel()


def set_parallel(on: bool) -> None:
    """Prompt chunks on every core (the BLAS threads, flashserve's dequantize), or on one
    thread with MLX's dequantize: the bench compares both, the tests check their tokens agree."""
    _parallel.on = on


def prompt_threads() -> int:
    """Threads a prompt chunk's BLAS calls take: every core this process may use."""
    if not _parallel.on:
        return 1
    if not _parallel.threads:
        _parallel.threads = cores.usable()
    return _parallel.threads


# Tokens per sequence up to which a call stays on the few-row kernel, as a
# decode step does: 1, or k+1 while a speculative verification pass runs
# (engine/speculative/), or 0 inside `prompt_rows`. Its k+1 rows cost the
# kernel little more than one, where dequantizing every weight for the BLAS
# costs ~25 decode steps on the default model; and each row's numbers are
# then a decode step's.
_decode_rows = [1]


@contextmanager
def decode_rows(tokens: int) -> Iterator[None]:
    """Within the block, calls of at most `tokens` tokens per sequence run as decode."""
    _decode_rows.append(tokens)
    try:
        yield
    finally:
        _decode_rows.pop()


def decode_limit() -> int:
    """Tokens per sequence up to which a call runs as decode now (see decode_rows)."""
    return _decode_rows[-1]


def prompt_rows() -> AbstractContextManager[None]:
    """Within the block every call runs as a prompt chunk's, even one of a single row:
    a prompt's last tokens (generation/prefill/last_token.py) get the numbers they would have
    in any longer chunk (attention too: compute/step_ops.py reads `all_prompt_rows`)."""
    return decode_rows(0)


def all_prompt_rows() -> bool:
    """Whether calls run as prompt rows whatever their size (inside `prompt_rows`)."""
    return _decode_rows[-1] == 0


class _Kept:
    """Dequantized weights kept for reuse while `keep_dequantized` is open; None: not kept."""

    slices: dict[int, tuple[mx.array, mx.Dtype, list[mx.array]]] | None = None


_kept = _Kept()


@contextmanager
def keep_dequantized() -> Iterator[None]:
    """Within the block, each linear dequantizes its weight once and reuses it.

    A layer-major prefill (generation/prefill/layer_major.py) runs every chunk of a prompt
    through one layer before the next: without this each chunk would make the
    layer's float weights again, and under a memory limit each of those large
    blocks is a fresh map, faulted in and zeroed page by page (issue 46: at
    256-token chunks that cost as much as the matmuls). The weights are kept
    only until the block ends, so at most one layer's are held. The numbers
    are the same: the same dequantize, the same matmul.
    """
    outer = _kept.slices
    _kept.slices = {}
    try:
        yield
    finally:
        _kept.slices = outer


# From this size of float copy on, a weight's prompt rows go to flashserve's
# kernel (compute/qmm.py) instead. glibc maps a block this large afresh each
# time, so the copy is faulted in page by page on every use and copy + BLAS
# loses to the kernel; below it the copy is a wash or favours the BLAS
# (docs/benchmarks/memory-cap.md has the measurements).
KERNEL_MIN_FLOAT_BYTES = 32 << 20
KERNEL_BITS = (4, 8)  # the widths of the kernel's AVX-512 path


# The `prompt_matmul` setting: the bits prompt rows are rounded to (0: float).
PROMPT_MATMUL_CHOICES = {"int16": 16, "int8": 8, "float": 0}
INTEGER_BITS = (4, 8)  # the widths of csrc/prompt_qgemm.cpp
INTEGER_GROUP_SIZES = (32, 64, 128)
_INTEGER_SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _integer_eligible(module: nn.QuantizedLinear) -> bool:
    """Static checks: a width, group size, mode and scales the integer GEMM takes."""
    scales = module.get("scales")
    return (
        module.bits in INTEGER_BITS
        and module.group_size in INTEGER_GROUP_SIZES
        and getattr(module, "mode", "affine") == "affine"
        and module.get("biases") is not None
        and scales is not None
        and scales.dtype in _INTEGER_SCALE_DTYPES
    )


def integer_available() -> bool:
    """Whether the integer prompt GEMM can run here (the extension has it; AVX2 at least)."""
    ext = qmm.extension()
    return ext is not None and hasattr(ext, "prompt_qgemm") and ext.prompt_qgemm_isa() != "none"


def on_integer(module: nn.QuantizedLinear, x: mx.array) -> bool:
    """Whether `module`'s prompt rows run on the integer GEMM: its `prompt_matmul` is
    "int16" or "int8", flashserve's CPU path is on, and the weights are ones it takes. Decided by
    the weights and settings alone, so every chunking of a prompt goes the same way."""
    return x.dtype == mx.float32 and integer_weights(module)


def integer_weights(module: nn.Module) -> bool:
    """Whether `module`'s float32 prompt rows run on the integer GEMM (`on_integer`)."""
    return (
        getattr(module, "_prompt_xbits", 0) > 0
        and qmm.active()
        and isinstance(module, qmm.FastQuantizedLinear)
        and integer_available()
        and _integer_eligible(module)
    )


class _IntegerKept:
    """Sibling outputs (q/k/v, gate/up) computed with the first one's call, by input."""

    def __init__(self) -> None:
        self.x: mx.array | None = None
        self.outputs: dict[int, mx.array] = {}


def _integer_output(module: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """x @ dequantize(weight).T on the integer GEMM; linears that share x (compute/qmm.py:
    _Siblings) in one call, x quantized once, each output the same as its own call's."""
    siblings = getattr(module, "_qmm_siblings", None) if qmm.fusion() else None
    members = [module]
    if siblings is not None and all(
        _integer_eligible(m)
        and (m.bits, m.group_size, getattr(m, "_prompt_xbits", 0))
        == (module.bits, module.group_size, module._prompt_xbits)
        for m in siblings.members
    ):
        members = siblings.members
        kept = siblings.__dict__.setdefault("_integer_kept", _IntegerKept())
        if kept.x is x and id(module) in kept.outputs:
            y = kept.outputs.pop(id(module))
            if not kept.outputs:
                kept.x = None  # all handed out: let x go
            return y
    ys = qmm.extension().prompt_qgemm(
        x,
        [m["weight"] for m in members],  # read each call: the layer streamer swaps arrays
        [m["scales"] for m in members],
        [m["biases"] for m in members],
        module.group_size,
        module.bits,
        module._prompt_xbits,
    )
    if len(members) > 1:
        kept.x = x
        kept.outputs = {id(m): y for m, y in zip(members, ys, strict=True) if m is not module}
    # By identity: modules are dicts, so list.index would compare their arrays.
    return ys[next(i for i, m in enumerate(members) if m is module)]


def on_kernel(module: nn.QuantizedLinear, x: mx.array) -> bool:
    """Whether `module`'s prompt rows run on flashserve's kernel (see KERNEL_MIN_FLOAT_BYTES).

    Decided by the weights alone, the same for every prompt, so a prompt's
    numbers do not depend on how it is chunked or cached; linears that share
    an input (q, k, v) decide together, since the kernel computes them in
    one call (compute/qmm.py: _Siblings).
    """
    ext = qmm.extension() if qmm.active() else None
    if ext is None or x.dtype != mx.float32 or not isinstance(module, qmm.FastQuantizedLinear):
        return False
    siblings = getattr(module, "_qmm_siblings", None)
    members = siblings.members if siblings is not None and qmm.fusion() else [module]
    if not ext.avx512_active() or any(
        m.bits not in KERNEL_BITS or getattr(m, "mode", "affine") != "affine" for m in members
    ):
        return False
    return max(_float_bytes(m, x.dtype) for m in members) >= KERNEL_MIN_FLOAT_BYTES


def _float_bytes(module: nn.QuantizedLinear, dtype: mx.Dtype) -> int:
    rows, groups = module["scales"].shape[-2:]
    return rows * groups * module.group_size * dtype.size


def float_copies(
    layer: nn.Module, dtype: mx.Dtype, kernel: bool, integer: bool = False
) -> tuple[int, int]:
    """(bytes of float weights a layer's prompt chunks hold under `keep_dequantized`,
    the most made at once without it), from its quantized linears' shapes (their
    arrays need not be loaded); `kernel`: flashserve's AVX-512 kernel will run,
    so weights of KERNEL_MIN_FLOAT_BYTES and up make no copy; `integer`: the
    integer GEMM will run (prompt_matmul "int16" or "int8"), so the weights it takes make
    none. The memory plan (streaming/denseplan.py) sets this much aside for a
    prefill. 0 off the CPU."""
    if mx.default_device() != mx.cpu:
        return 0, 0
    sizes = []
    for name, module in layer.named_modules():
        if not isinstance(module, nn.QuantizedLinear) or name.split(".")[-1] == "lm_head":
            continue
        size = _float_bytes(module, dtype)
        if integer and _integer_eligible(module):
            continue
        if kernel and module.bits in KERNEL_BITS and size >= KERNEL_MIN_FLOAT_BYTES:
            continue
        sizes.append(size)
    return sum(sizes), min(max(sizes, default=0), SLICE_BYTES)


class PromptQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose multi-token inputs run as dequantize + float matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim < 3 or x.shape[-2] <= _decode_rows[-1]:
            return super().__call__(x)
        threads = prompt_threads() if x.shape[-2] >= MIN_THREADED_ROWS else 1
        each = x.shape[-2] >= EVAL_EACH_FROM_ROWS
        if on_integer(self, x):
            y = _integer_output(self, x)
            if each:
                with blas.prompt_threads(threads):  # computed now: as on_kernel's, below
                    mx.eval(y)
            return y + self["bias"] if "bias" in self else y
        if on_kernel(self, x):
            y = super().__call__(x)
            # Computed now, as the BLAS path computes each slice: a chunk's work
            # up to here is done before the next chunk's is built, or a
            # layer-major prefill would hold every chunk's activations at once.
            # That work includes attention's matmuls when this is o_proj: on
            # every core, as under a BLAS linear (on one thread they were a
            # large share of a prefill from disk: docs/benchmarks/memory-cap.md).
            if each:
                with blas.prompt_threads(threads):
                    mx.eval(y)
            return y
        weight, scales = self["weight"], self["scales"]
        biases = self.get("biases")
        rows = weight.shape[0]
        in_features = scales.shape[-1] * self.group_size
        step = max(1, SLICE_BYTES // (in_features * x.dtype.size))
        outputs = []
        kept = _kept.slices
        # By identity: a streamed layer's arrays are swapped between uses.
        reuse = None if kept is None else kept.get(id(self))
        if reuse is not None and (reuse[0] is not weight or reuse[1] != x.dtype):
            reuse = None
        made: list[mx.array] = []
        for i, start in enumerate(range(0, rows, step)):
            part = slice(start, start + step)
            if reuse is not None:
                dense = reuse[2][i]
            else:
                # In x's dtype: dequantize computes in the scales' dtype, and a GGUF's
                # float16 scales (compute/half_scales.py) would round every weight.
                part_scales = scales[part].astype(x.dtype)
                part_biases = None
                if biases is not None:  # a 0-d one stands for a multiple of the scales
                    part_biases = (biases if biases.ndim == 0 else biases[part]).astype(x.dtype)
                dense = _dequantize(
                    weight[part],
                    part_scales,
                    qmm.full_biases(part_scales, part_biases),
                    self.group_size,
                    self.bits,
                    self.mode,
                    x.dtype,
                )
                if kept is not None:  # else each slice goes as soon as it is used
                    made.append(dense)
            outputs.append(x @ dense.T)
            # Computed now, so this slice's float weight is freed before the next
            # one (or the next layer's) is made: MLX would otherwise schedule the
            # dequantizes of several layers ahead of their matmuls. This also
            # computes x, the layer's work up to here (attention's matmuls
            # included): all of it on every core.
            with blas.prompt_threads(threads):
                mx.eval(outputs[-1])
        if kept is not None and made:
            kept[id(self)] = (weight, x.dtype, made)
        y = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=-1)
        if "bias" in self:
            y = y + self["bias"]
        return y


def _dequantize(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str,
    dtype: mx.Dtype,
) -> mx.array:
    """mx.dequantize, on every core where flashserve's CPU path runs (csrc/prompt_dequant.cpp:
    MLX's numbers exactly); MLX's single-threaded op for what that one does not take."""
    ext = qmm.extension() if qmm.active() and _parallel.on else None
    if (
        ext is not None
        and hasattr(ext, "dequantize")  # an extension built before this op has none
        and mode == "affine"
        and bits in DEQUANT_BITS
        and biases is not None
        and dtype == scales.dtype == biases.dtype == mx.float32
        and weight.ndim == 2
    ):
        return ext.dequantize(weight, scales, biases, group_size, bits)
    return mx.dequantize(
        weight, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=dtype
    )


def use_blas_for_prompts(model: nn.Module, choice: str = "int16") -> int:
    """Switch the model's quantized linears to PromptQuantizedLinear on the CPU.

    The modules change class in place: their arrays, freeze state, and the
    references the layer streamer holds stay as they are. Returns how many
    modules changed (0 on a GPU). `choice`: the `prompt_matmul` setting, kept
    per module (set_prompt_matmul changes it), so each model has its own.

    The LM head keeps MLX's kernel: prefill discards the logits of a prompt
    chunk, so MLX never computes them, but the slice-by-slice evaluation
    above would compute them all (a 128k-vocabulary head over 512 tokens).
    """
    if mx.default_device() != mx.cpu:
        return 0
    changed = 0
    for name, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and name.split(".")[-1] != "lm_head":
            module.__class__ = PromptQuantizedLinear
            changed += 1
    set_prompt_matmul(model, choice)
    return changed


def set_prompt_matmul(model: nn.Module, choice: str) -> None:
    """The `prompt_matmul` setting for a model's prompt linears and its offloaded experts'
    prefill rows: "int16" or "int8" (the integer GEMM where it runs, rows rounded to
    that many bits) or "float" (dequantize + BLAS, or the few-row kernel)."""
    if choice not in PROMPT_MATMUL_CHOICES:
        raise ValueError(
            f"prompt_matmul must be one of {list(PROMPT_MATMUL_CHOICES)}, not {choice!r}"
        )
    for _, module in model.named_modules():
        if isinstance(module, PromptQuantizedLinear):
            module._prompt_xbits = PROMPT_MATMUL_CHOICES[choice]
        elif hasattr(type(module), "set_prompt_xbits"):
            # An offloaded MoE's experts (experts/install.py): their prefill rows too.
            module.set_prompt_xbits(PROMPT_MATMUL_CHOICES[choice])
