"""Quantized matmuls with few rows on the CPU: flashserve's kernel instead of MLX's.

MLX's CPU kernel for a quantized matmul is scalar and single-threaded, and
costs the same per row at any batch size: on the default model one decode
step spent 108 of its 161 ms there (issue 22). flashserve's kernel
(csrc/, built at install time by setup.py) reads the same packed weights,
scales and biases as they are. On CPUs with AVX-512, 4- and 8-bit weights
(GGUF Q4/Q8, mlx-lm's default) take csrc/qmm_avx512.cpp: nibbles become
floats through a 16-entry table lookup, and each group's scale and bias are
factored out of the sum (one FMA per weight). Other widths, and CPUs with
AVX2 only, take csrc/qmm_kernels.cpp, which unpacks 32 values at a time into
AVX2 registers. With the `decode_matmul` setting "int16" (the default),
4- and 8-bit weights take csrc/qmm_avx512_int.cpp (qmm_avx2_int.cpp on CPUs
without AVX-512) instead: x rounded per block of 32 exactly as the prompt
GEMM rounds it, integer dot products (VNNI where present), one column's
weights read as one stream: on AVX-512 ~1.5x the float kernel's speed over a
1.2B model's weights on one core (a core's memory bandwidth), for x's
rounding (a top-5 next-token probability moves under 0.001). Each unpacked
vector serves every row of x; only large
problems (256K weights x rows and up: the LM head, one row of a 576 x 576
linear, batched steps) are split over the cores.

It is an MLX primitive (csrc/qmm_module.cpp), so it stays in MLX's lazy
graph like the op it replaces. It takes:

- quantized linears (decode steps, the LM head), except prompt chunks, which
  compute/prompt_matmul.py gives to the BLAS; linears of one block that read
  the same input (q/k/v, gate/up) run as one op (`_Siblings`): each MLX op
  costs microseconds of dispatch on the CPU, whatever its size;
- embeddings used as the LM head (`QuantizedEmbedding.as_linear`);
- the expert matmuls of MoE blocks (`QuantizedSwitchLinear`), resident or
  offloaded: both take this path, so they stay bit-identical.

A row's result does not depend on the other rows in the call, so batching
does not change a request's numbers; the result is within float32 rounding
of MLX's kernel (the tests compare them on every width and group size).
Only float32 inputs and MLX's affine mode are taken (2, 3, 4, 5, 6, 8 bits;
groups of 32, 64, 128); anything else, a GPU, or a machine where the kernel
was not built or its CPU lacks AVX2, FMA and F16C, keeps MLX's kernel. The
`quantized_matmul` setting forces either: "auto" (the fast path where it can run), "fast", "mlx".
The same switch turns compute/step_ops.py's ops (norms, RoPE, attention,
SwiGLU, log-sum-exp) on and off: one fast CPU path.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from flashserve.engine.compute import cores

log = logging.getLogger(__name__)

QmmChoice = Literal["auto", "fast", "mlx"]
CHOICES: tuple[str, ...] = ("auto", "fast", "mlx")

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


class QmmError(Exception):
    """The fast path was asked for and cannot run here (the message says why)."""


class _State:
    module: ModuleType | None = None  # the compiled extension, once found usable
    reason: str | None = None  # why it is not usable; None before the first check
    checked = False
    active = False  # whether eligible calls take the fast path now
    chosen: str | None = None  # what select() decided: "fast" or "mlx"
    fuse = True  # whether sibling linears (q/k/v, gate/up) share one kernel call


_state = _State()


def _probe() -> tuple[ModuleType | None, str | None]:
    """The extension if it can run here, else None and the reason."""
    if mx.default_device() != mx.cpu:
        return None, "MLX computes on the GPU, where its own kernels are fast"
    try:
        from flashserve.engine.compute import _qmm  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"the kernel was not built at install time ({exc})"
    if not _qmm.cpu_supported():
        return None, "this CPU lacks AVX2, FMA or F16C"
    built, running = _qmm.compiled_mlx_version(), mx.__version__.split(".dev")[0]
    if built != running:
        return None, f"the kernel was built against MLX {built}, this is MLX {running}"
    try:
        # One tiny call: an MLX whose C++ types differ from the ones compiled
        # against (nanobind ABI, primitive layout) fails here, not mid-request.
        w = mx.arange(64 * 64, dtype=mx.float32).reshape(64, 64) / 4096.0
        wq, scales, biases = mx.quantize(w, group_size=32, bits=4)
        x = mx.ones((1, 64))
        got = _qmm.qmm(x, wq, scales, biases, 32, 4)
        want = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=32, bits=4)
        if not mx.allclose(got, want, rtol=1e-4, atol=1e-4).item():
            return None, "the kernel disagrees with MLX's on a test matrix"
    except Exception as exc:  # any failure means MLX's kernel, never a crash
        return None, f"the kernel cannot run with this MLX ({type(exc).__name__}: {exc})"
    return _qmm, None


def unavailable_reason() -> str | None:
    """None when the fast path can run in this process; else why not."""
    if not _state.checked:
        _state.module, _state.reason = _probe()
        _state.checked = True
    return _state.reason


def select(choice: str = "auto") -> str:
    """Choose the kernel for this process: returns "fast" or "mlx".

    "auto" takes the fast path where it can run and says in one log line
    when it cannot; "fast" raises QmmError where it cannot; "mlx" never
    takes it.
    """
    if choice not in CHOICES:
        raise QmmError(f"quantized_matmul {choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "mlx":
        _state.active, _state.chosen = False, "mlx"
        return "mlx"
    reason = unavailable_reason()
    if reason is not None:
        if choice == "fast":
            raise QmmError(f"quantized_matmul 'fast' cannot run here: {reason}")
        if _state.chosen != "mlx":
            log.info("quantized matmuls use MLX's kernel: %s", reason)
        _state.active, _state.chosen = False, "mlx"
        return "mlx"
    if _state.chosen != "fast":
        # The pool starts one thread per core of the affinity mask; a cgroup
        # CPU quota below that would make the extra threads wait on each other.
        usable = cores.usable()
        if _state.module.threads() > usable:
            _state.module.set_threads(usable)
        log.info(
            "quantized matmuls with few rows use flashserve's CPU kernel (%d threads)",
            _state.module.threads(),
        )
    _state.active, _state.chosen = True, "fast"
    return "fast"


def active() -> bool:
    """Whether eligible quantized matmuls take the fast path now."""
    return _state.active


def set_active(on: bool) -> None:
    """Turn the fast path on or off for modules already switched (the bench compares both)."""
    if on and unavailable_reason() is not None:
        raise QmmError(f"quantized_matmul 'fast' cannot run here: {_state.reason}")
    _state.active = on


def extension() -> ModuleType | None:
    """The compiled extension where the fast path can run here, else None."""
    unavailable_reason()
    return _state.module


def set_threads(n: int) -> None:
    """Threads the kernel uses, the calling one included; 0: one per core."""
    if unavailable_reason() is None:
        _state.module.set_threads(n)


def kernel_isa() -> str | None:
    """The fast kernel's instruction set for 4- and 8-bit weights here, or None without it."""
    if unavailable_reason() is not None:
        return None
    return "AVX-512" if _state.module.avx512_active() else "AVX2"


def set_avx512(on: bool) -> bool:
    """Allow or forbid the AVX-512 kernel (tests check AVX2's); returns whether it runs now."""
    if unavailable_reason() is not None:
        return False
    _state.module.set_avx512(on)
    return bool(_state.module.avx512_active())


DECODE_CHOICES: dict[str, int] = {"int16": 16, "float": 0}


def set_decode_matmul(choice: str) -> None:
    """How 4- and 8-bit matmuls on flashserve's kernel take x, process-wide: "int16" rounds
    each row per block of 32 as the prompt GEMM does and multiplies with integer dot
    products (csrc/qmm_avx512_int.cpp, qmm_avx2_int.cpp); "float" keeps x in float32
    (csrc/qmm_avx512.cpp, qmm_kernels.cpp)."""
    if choice not in DECODE_CHOICES:
        raise QmmError(f"decode_matmul {choice!r}: choose one of {', '.join(DECODE_CHOICES)}")
    if unavailable_reason() is None and hasattr(_state.module, "set_x_bits"):
        _state.module.set_x_bits(DECODE_CHOICES[choice])


def decode_matmul() -> str:
    """What 4- and 8-bit few-row matmuls on flashserve's kernel do with x now: int16 or float."""
    ext = extension()
    on = ext is not None and hasattr(ext, "x_bits") and ext.x_bits() == 16
    return "int16" if on else "float"


def process_settings() -> dict[str, str]:
    """The process-wide kernel settings in force, as EngineConfig fields: for loading a
    second model into this process (a draft model) without resetting them to defaults."""
    chosen = "mlx" if _state.chosen == "mlx" else "auto"
    return {"quantized_matmul": chosen, "decode_matmul": decode_matmul()}


def set_vnni(on: bool) -> bool:
    """Allow or forbid VNNI (AVX-512 VNNI; AVX-VNNI on the AVX2 kernel) in the int16 kernels
    (tests check vpmaddwd's path, which gives the same numbers); returns whether it is used
    now."""
    if unavailable_reason() is not None:
        return False
    _state.module.set_vnni(on)
    return bool(_state.module.vnni_active())


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    rows_expert: mx.array | None = None,
) -> mx.array:
    """x @ dequantize(w).T with the fast kernel (x float32; w 2-D, or 3-D with rows_expert).

    With rows_expert, row r of x (leading dimensions flattened) uses expert
    rows_expert[r] of the stacked weight. Raises QmmError where the kernel
    cannot run.
    """
    if unavailable_reason() is not None:
        raise QmmError(f"quantized_matmul 'fast' cannot run here: {_state.reason}")
    if rows_expert is None:
        return _state.module.qmm(x, w, scales, biases, group_size, bits)
    return _state.module.gather_qmm(x, w, scales, biases, rows_expert, group_size, bits)


_TIMES: dict[float, mx.array] = {}


def scaled_biases(times: int) -> mx.array:
    """The biases array that stands for `times` x the scales (a 0-d float32 array): what a
    symmetric quant's linears hold instead of biases (weights/derived.py). Only the fast
    kernel takes it (`takes_scaled_biases`); `full_biases` makes the real ones."""
    key = float(times)
    if key not in _TIMES:
        _TIMES[key] = mx.array(key, dtype=mx.float32)
        mx.eval(_TIMES[key])  # concrete: no thread evaluates it later
    return _TIMES[key]


def full_biases(scales: mx.array, biases: mx.array | None) -> mx.array | None:
    """`biases` as an array of the scales' shape: a `scaled_biases` array made into the
    biases it stands for (times a power of two: each product exact), others as they are."""
    if biases is None or biases.ndim != 0:
        return biases
    return scales * biases.astype(scales.dtype)


def takes_scaled_biases(module: Any) -> bool:
    """Whether `module` may hold `scaled_biases` instead of its biases: a quantized linear
    the fast kernel takes, in a process where it runs (select() chose it) and the built
    kernel reads such biases. Its other paths (MLX's kernel, the prompt BLAS) make the
    biases where they use them (`full_biases`)."""
    ext = _state.module
    return (
        _state.chosen == "fast"
        and ext is not None
        and bool(getattr(ext, "biases_of_scales", False))
        and isinstance(module, nn.QuantizedLinear)
        and _eligible(module)
    )


def _eligible(module: Any) -> bool:
    """Static checks: affine mode, a bit width, group size and scale dtype the kernel takes."""
    scales = module.get("scales") if isinstance(module, dict) else None
    return (
        getattr(module, "mode", "affine") == "affine"
        and module.bits in BITS
        and module.group_size in GROUP_SIZES
        and module.get("biases") is not None
        and scales is not None
        and scales.dtype in _SCALE_DTYPES
        and getattr(module, "global_scale", None) is None
    )


class _Siblings:
    """Quantized linears of one block that read the same input (q, k, v; gate, up).

    The first of them called with an input computes all of their outputs in
    one op (the kernel's qmm_multi: one graph node instead of three, each
    output exactly what its own call computes) and keeps the others' for
    their calls with that same array. A call with another input, or a second
    call, computes afresh, so a model that calls them otherwise is still right.
    """

    def __init__(self, members: list[FastQuantizedLinear]) -> None:
        self.members = members
        # By identity: modules are dicts, so == (and list.index) would compare contents.
        self.index = {id(m): i for i, m in enumerate(members)}
        self.group_sizes = [m.group_size for m in members]
        self.bits = [m.bits for m in members]
        self.x: mx.array | None = None  # the input the kept outputs belong to
        self.kept: dict[int, mx.array] = {}  # member index -> output not yet taken

    def output(self, member: FastQuantizedLinear, x: mx.array) -> mx.array:
        # ~60 calls a decode step on the graph thread, which shares the CPU with the kernel.
        index = self.index[id(member)]
        if self.x is x and index in self.kept:
            y = self.kept.pop(index)
            if not self.kept:
                self.x = None  # nothing left to hand out: let x go
            return y
        ms = self.members  # arrays read each call: the layer streamer swaps them
        ys = _state.module.qmm_multi(
            x,
            [m["weight"] for m in ms],
            [m["scales"] for m in ms],
            [m["biases"] for m in ms],
            self.group_sizes,
            self.bits,
        )
        self.x = x
        self.kept = {i: y for i, y in enumerate(ys) if i != index}
        return ys[index]


class FastQuantizedLinear(nn.QuantizedLinear):
    """A QuantizedLinear whose float32 inputs go to flashserve's kernel while it is active."""

    def __call__(self, x: mx.array) -> mx.array:
        if not (_state.active and x.dtype == mx.float32):
            if self["biases"].ndim != 0:
                return super().__call__(x)
            y = mx.quantized_matmul(  # MLX's kernel with the biases `scaled_biases` stands for
                x,
                self["weight"],
                scales=self["scales"],
                biases=full_biases(self["scales"], self["biases"]),
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )
            return y + self["bias"] if "bias" in self else y
        siblings: _Siblings | None = getattr(self, "_qmm_siblings", None)
        if siblings is not None and _state.fuse:
            y = siblings.output(self, x)
        else:
            y = _state.module.qmm(
                x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits
            )
        if "bias" in self:
            y = y + self["bias"]
        return y


class FastQuantizedEmbedding(nn.QuantizedEmbedding):
    """A QuantizedEmbedding whose use as the LM head (as_linear) goes to flashserve's kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not (_state.active and x.dtype == mx.float32):
            return super().as_linear(x)
        return _state.module.qmm(
            x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits
        )


class FastQuantizedSwitchLinear(QuantizedSwitchLinear):
    """mlx-lm's expert linear (gather_qmm) on flashserve's kernel: one expert per row."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        # SwitchGLU hands in x as (..., 1, K): one row per (token, expert) slot.
        if not (_state.active and x.dtype == mx.float32 and x.ndim >= 2 and x.shape[-2] == 1):
            return super().__call__(x, indices, sorted_indices)
        batch = tuple(mx.broadcast_shapes(x.shape[:-2], indices.shape))
        rows = mx.broadcast_to(x.squeeze(-2), (*batch, x.shape[-1]))
        experts = mx.broadcast_to(indices, batch).astype(mx.uint32)
        weight = self["weight"]
        # A list: the expert cache's experts, each where it lies (experts/compute.py).
        gather = (
            _state.module.gather_qmm_list if isinstance(weight, list) else _state.module.gather_qmm
        )
        y = gather(
            rows, weight, self["scales"], self["biases"], experts, self.group_size, self.bits
        )
        y = mx.expand_dims(y, -2)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


_FAST_BASES: tuple[type, ...] = (
    FastQuantizedLinear,
    FastQuantizedEmbedding,
    FastQuantizedSwitchLinear,
)
_combined: dict[type, type] = {}


def _fast_class(cls: type) -> type | None:
    """The fast class for a module class: its own, or `cls` with the fast one after it.

    A subclass (compute/prompt_matmul.py's PromptQuantizedLinear, the float32
    embedding of compute/half_scales.py) keeps its own behaviour and hands
    what it does not handle to the fast class through super().
    """
    if issubclass(cls, _FAST_BASES):
        return None
    for fast in _FAST_BASES:
        base = fast.__mro__[1]
        if cls is base:
            return fast
        if issubclass(cls, base):
            if cls not in _combined:
                _combined[cls] = type(f"Fast{cls.__name__}", (cls, fast), {})
            return _combined[cls]
    return None


def use_fast_qmm(model: nn.Module) -> int:
    """Switch the model's eligible quantized modules to the fast classes, in place.

    Does nothing (returns 0) when select() chose MLX's kernel. The modules
    keep their arrays and freeze state; only their class changes. Returns
    how many changed.
    """
    if _state.chosen is None:
        select("auto")
    if _state.chosen != "fast":
        return 0
    changed = 0
    for _, module in model.named_modules():
        fast = _fast_class(type(module))
        if fast is not None and _eligible(module):
            module.__class__ = fast
            changed += 1
    _group_siblings(model)
    return changed


# Linears of one block that read the same input, by mlx-lm's attribute names.
SIBLING_NAMES: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


def _group_siblings(model: nn.Module) -> None:
    """Give each set of fast sibling linears (same block, same input width) a _Siblings."""
    if _state.module is None or not hasattr(_state.module, "qmm_multi"):
        return
    for _, module in model.named_modules():
        for names in SIBLING_NAMES:
            members = [getattr(module, name, None) for name in names]
            if not all(isinstance(m, FastQuantizedLinear) for m in members):
                continue
            widths = {m["scales"].shape[-1] * m.group_size for m in members}
            if len(widths) != 1 or any(getattr(m, "_qmm_siblings", None) for m in members):
                continue
            group = _Siblings(members)
            for m in members:
                m._qmm_siblings = group


def fusion() -> bool:
    """Whether sibling linears share one kernel call now."""
    return _state.fuse


def set_fusion(on: bool) -> None:
    """Whether sibling linears share one kernel call (on by default; the bench compares)."""
    _state.fuse = on
