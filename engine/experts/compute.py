"""The arithmetic of an offloaded MoE call: mlx-lm's own SwitchGLU on the cached experts.

The original SwitchGLU stays as a template whose expert tensors are swapped
in for a call. On flashserve's CPU kernel (compute/qmm.py) the template runs
once per call with each tensor a list of the needed experts' arrays, used
where they lie in the cache; otherwise each needed expert runs on the token
slots routed to it. Either way a slot's arithmetic is the resident model's,
so the output is bit-identical to it (experts/offload.py decides which
experts and where their tensors come from).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models import switch_layers

from flashserve.engine.compute import qmm, step_ops
from flashserve.engine.experts.cache import ExpertCache
from flashserve.engine.experts.store import SwitchLayout

EMPTY = mx.zeros((0,))

# mlx-lm's SwitchGLU sorts a call's slots by expert from this many on (switch_layers.py).
# The sort picks the kernel off the CPU (MLX's CUDA backend: a grouped GEMM sorted, a
# matrix-vector product per slot not), so a slot's arithmetic depends on it there.
SORT_SLOTS = 64

# One expert's SwitchGLU as one op: (x, the expert's rows of x, its tensors) -> output rows.
GluOp = Callable[[mx.array, np.ndarray, dict[str, mx.array]], mx.array]


@dataclass
class OffloadLayer:
    layer: int
    layout: SwitchLayout
    template: nn.Module  # the original SwitchGLU, expert tensors swapped in per call
    slots: list[tuple[Any, str, str]] = field(default_factory=list)  # (module, key, tensor name)
    top_k: int = 0
    router: nn.Module | None = None  # this layer's router (resident copy), for prefetch
    next_layer: int | None = None
    slab: dict[str, mx.array] | None = None  # every expert stacked, when all are cached
    every: EveryCached | None = None  # tensor lists over every cached expert (built_ahead)


@dataclass
class EveryCached:
    """Per tensor name, a list indexed by expert id: the cached experts' arrays, and
    a stand-in (another cached expert's) where one is not cached."""

    version: int  # the cache's version of the layer when the lists were made
    tensors: dict[str, list[mx.array]]


def compute(
    info: OffloadLayer,
    x: mx.array,
    indices: mx.array,
    ids: np.ndarray,
    needed: np.ndarray,
    weights: dict[int, dict[str, mx.array]],
    stacked: bool = False,
) -> mx.array:
    """A decode call on the needed experts' tensors (`ids`: indices, evaluated).

    `stacked` copies the needed experts into one stack per tensor (an option
    kept for comparison); otherwise a list of them on flashserve's kernel, or
    one expert at a time.
    """
    if stacked or listable(info, x):
        lut = np.zeros(info.layout.num_experts, dtype=np.uint32)
        lut[needed] = np.arange(len(needed), dtype=np.uint32)
        remapped = mx.array(lut[ids]).astype(indices.dtype)
        return call_template(info, x, remapped, [int(e) for e in needed], weights, stacked)
    k = ids.shape[-1]
    flat_x, flat_ids = x.reshape(-1, x.shape[-1]), ids.reshape(-1, k)
    outs, positions = per_expert(info, flat_x, flat_ids, needed, weights)
    return restore_order(outs, positions, ids.shape)


def built_ahead(
    info: OffloadLayer, x: mx.array, indices: mx.array, cache: ExpertCache
) -> tuple[mx.array, int] | None:
    """The call on every cached expert, built before its routing is evaluated.

    The template runs on lists indexed by expert id (the routing needs no
    remap), so the graph can be built while the router still computes: once
    the ids are known, a call whose experts are all cached (and whose lists
    are current: the returned cache version still stands) starts computing at
    once, with no Python between the sync and the compute. Rows only read
    their own experts, so the stand-ins of uncached experts are never read,
    and each row's arithmetic is the list path's (bit-identical to
    resident). None where the list path cannot run or nothing is cached.
    """
    if not listable(info, x):
        return None
    layer = info.layer
    version = cache.version(layer)
    every = info.every
    if every is None or every.version != version:
        entries = [cache.peek((layer, e)) for e in range(info.layout.num_experts)]
        stand_in = next((entry for entry in entries if entry is not None), None)
        if stand_in is None:
            info.every = None
            return None
        every = EveryCached(
            version,
            {
                name: [(stand_in if entry is None else entry).tensors[name] for entry in entries]
                for _, _, name in info.slots
            },
        )
        info.every = every
    return run_template(info, x, indices, every.tensors), version


def per_expert(
    info: OffloadLayer,
    x2: mx.array,
    flat: np.ndarray,
    experts: np.ndarray,
    weights: dict[int, dict[str, mx.array]],
    fused: GluOp | None = None,
    token_sorts: np.ndarray | None = None,
) -> tuple[list[mx.array], list[np.ndarray]]:
    """Run the template once per expert on the token slots routed to it, or `fused`
    (fused_glu's op for this call, asked once by the caller) where given.

    Each expert's tensors go in as a one-expert stack (`w[None]`, a view,
    no copy) with indices all 0, so the arithmetic per slot is the same
    gather_qmm / gather_mm as the resident SwitchGLU's, sorted or not as the
    resident call would be: the whole call's, or per token `token_sorts`
    (slot_sorts) for a call merged from several. Each output's rows are in
    slot order.
    """
    k = flat.shape[-1]
    whole = flat.size >= SORT_SLOTS
    outs, positions = [], []
    for e in experts:
        rows, cols = np.nonzero(flat == e)
        if fused is not None:  # the CPU's kernel: sorting changes no number there
            outs.append(fused(x2, rows, weights[int(e)]))
            positions.append(rows * k + cols)
            continue
        if token_sorts is None:
            groups = [(rows, cols, whole)]
        else:  # at most two calls: the slots of runs sorted, and of runs not
            sorts = token_sorts[rows]
            groups = [(rows[sorts == s], cols[sorts == s], s) for s in (False, True) if s in sorts]
        for rows, cols, sort in groups:
            sub_x = (
                x2
                if len(rows) == x2.shape[0] and (rows == np.arange(len(rows))).all()
                else x2[mx.array(rows.astype(np.uint32))]
            )
            zeros = mx.zeros((len(rows), 1), dtype=mx.uint32)
            out = call_template(info, sub_x, zeros, [int(e)], weights, sort=sort)
            outs.append(out.reshape(len(rows), -1))
            positions.append(rows * k + cols)
    return outs, positions


def slot_sorts(k: int, parts: list[int]) -> np.ndarray | None:
    """Per token of a call merged from `parts` (token counts of consecutive runs, each
    a call of its own in the resident model): whether its run's call sorts its slots.
    None where every run decides as the merged call would."""
    whole = sum(parts) * k >= SORT_SLOTS
    each = [n * k >= SORT_SLOTS for n in parts]
    if all(sort == whole for sort in each):
        return None
    return np.repeat(np.array(each), parts)


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def projection_names(info: OffloadLayer) -> dict[str, dict[str, str]]:
    """Per projection of the template, its tensors' names in a record, by key."""
    names: dict[str, dict[str, str]] = {}
    for module, key, name in info.slots:
        for proj in PROJECTIONS:
            if module is getattr(info.template, proj, None):
                names.setdefault(proj, {})[key] = name
    return names


def fused_glu(info: OffloadLayer, x2: mx.array) -> GluOp | None:
    """One expert's whole SwitchGLU as one op of flashserve's kernel (csrc/expert_ops.cpp),
    where the template is mlx-lm's plain SwitchGLU on the fast path; else None.

    The op reads the expert's rows of x where they lie and keeps gate, up and
    SwiGLU in reused buffers: none of the template's copies (its sort above
    64 slots among them), one graph node instead of ten, each part on every
    core. It computes what the template computes, number for number: the
    same kernel per row, the same SwiGLU function (tests compare them).
    """
    ext = qmm.extension()
    template = info.template
    activation = getattr(template, "activation", None)
    if not (
        _paths.fused
        and x2.dtype == mx.float32
        and ext is not None
        and hasattr(ext, "expert_glu")  # an extension built before the op has none
        and step_ops.active()
        and type(template).__call__ is switch_layers.SwitchGLU.__call__
        and type(activation).__call__ is switch_layers.SwiGLU.__call__
        and switch_layers.swiglu is step_ops.swiglu  # the op's SwiGLU is the template's
    ):
        return None
    names = projection_names(info)
    modules = [getattr(template, proj, None) for proj in PROJECTIONS]
    if not all(
        isinstance(m, qmm.FastQuantizedSwitchLinear)
        and getattr(m, "mode", "affine") == "affine"
        and "bias" not in m
        and set(names.get(proj, {})) == {"weight", "scales", "biases"}
        for proj, m in zip(PROJECTIONS, modules, strict=True)
    ):
        return None
    group_sizes = [m.group_size for m in modules]
    bits = [m.bits for m in modules]

    def run(x: mx.array, rows: np.ndarray, tensors: dict[str, mx.array]) -> mx.array:
        parts = [
            [tensors[names[proj][key]] for key in ("weight", "scales", "biases")]
            for proj in PROJECTIONS
        ]
        return ext.expert_glu(x, mx.array(rows.astype(np.uint32)), *parts, group_sizes, bits)

    return run


class _Paths:
    """How a prefill computes its experts (the bench and tests compare the paths)."""

    fused = True  # one op per expert where fused_glu() allows; off: the template
    concurrent = True  # the template's experts two at a time where expert_streams() allows
    # The second stream, made once per thread: MLX's streams belong to the thread
    # that made them (each engine's worker is a thread of its own).
    local = threading.local()


_paths = _Paths()


def set_fused_experts(on: bool) -> None:
    """A prefill's experts as one op each where fused_glu() allows (the default), or
    through the template (the bench and tests compare both)."""
    _paths.fused = on


def set_concurrent_experts(on: bool) -> None:
    """The template's experts two at a time on two streams (the default), or one at a
    time on the current stream, as before issue 46 (the bench compares both)."""
    _paths.concurrent = on


def expert_streams() -> list[mx.Stream]:
    """The MLX streams a prefill runs its experts on, one expert per stream at a time.

    On flashserve's kernel with two cores or more: the current stream and a
    second CPU stream, each computing on its own thread. Two experts then run
    at once, each whole (the gathers, SwiGLU and copies between the matmuls
    included, which the kernel's pool does not split), and neither waits on
    the other between its matmuls. A row's arithmetic is the same on any
    thread, so the output is too. Else only the current stream.
    """
    current = mx.default_stream(mx.default_device())
    ext = qmm.extension()
    # The kernel's thread count: one thread (the bench's one_thread) means one stream.
    if not (_paths.concurrent and qmm.active() and ext is not None and current.device == mx.cpu):
        return [current]
    if ext.threads() < 2:
        return [current]
    second = getattr(_paths.local, "stream", None)
    if second is None:
        second = _paths.local.stream = mx.new_stream(mx.cpu)
    return [current, second]


def listable(info: OffloadLayer, x: mx.array) -> bool:
    """Whether the template's linears take a list of experts here (flashserve's kernel).

    One kernel call per projection over every needed expert replaces one
    template call per expert (about ten graph nodes and their Python each).
    """
    return (
        qmm.active()
        and x.dtype == mx.float32
        and all(
            isinstance(module, qmm.FastQuantizedSwitchLinear) and key != "bias"
            for module, key, _ in info.slots
        )
    )


def call_template(
    info: OffloadLayer,
    x: mx.array,
    remapped: mx.array,
    experts: list[int],
    weights: dict[int, dict[str, mx.array]],
    stack: bool = True,
    sort: bool | None = None,
) -> mx.array:
    """The template once, remapped[i] indexing `experts`: their tensors stacked, or as
    lists (`stack` False; only where listable()); `sort` as in run_template."""
    tensors: dict[str, Any] = {}
    for _, _, name in info.slots:
        parts = [weights[e][name] for e in experts]
        if stack:
            tensors[name] = parts[0][None] if len(parts) == 1 else mx.stack(parts)
        else:
            tensors[name] = parts
    return run_template(info, x, remapped, tensors, sort)


def run_template(
    info: OffloadLayer,
    x: mx.array,
    indices: mx.array,
    tensors: dict[str, Any],
    sort: bool | None = None,
) -> mx.array:
    """The original SwitchGLU on `tensors` (stacked experts, or lists of them, by name).

    `sort`: whether the slots are sorted by expert, where the caller decides it (a
    part of the call the resident model makes); None: the template's own choice.
    """
    for module, key, name in info.slots:
        module[key] = tensors[name]
    try:
        template = info.template
        if sort is None or sort == (indices.size >= SORT_SLOTS):
            return template(x, indices)
        if type(template).__call__ is not switch_layers.SwitchGLU.__call__:
            return template(x, indices)  # its own choice: no other sort can be asked of it
        return _switch_glu(template, x, indices, sort)
    finally:
        # The lazy graph keeps what it needs; the template must not pin the
        # stacked tensors past this call.
        for module, key, _ in info.slots:
            module[key] = EMPTY


def _switch_glu(template: nn.Module, x: mx.array, indices: mx.array, sort: bool) -> mx.array:
    """mlx-lm's SwitchGLU.__call__ with the sort given instead of decided by the call's
    size (one expert's slots of a call that the resident model sorts, or not). Its
    own sort helpers; the same projections and activation."""
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    idx, inverse = indices, None
    if sort:
        x, idx, inverse = switch_layers._gather_sort(x, indices)
    up = template.up_proj(x, idx, sorted_indices=sort)
    gate = template.gate_proj(x, idx, sorted_indices=sort)
    x = template.down_proj(template.activation(up, gate), idx, sorted_indices=sort)
    if sort:
        x = switch_layers._scatter_unsort(x, inverse, indices.shape)
    return x.squeeze(-2)


def split_rows(whole: mx.array, parts: list[int]) -> list[mx.array]:
    """Consecutive runs of `parts[i]` rows of `whole` (views)."""
    bounds = [0, *itertools.accumulate(parts)]
    return [whole[a:b] for a, b in itertools.pairwise(bounds)]


def restore_parts(
    outs: list[mx.array], positions: list[np.ndarray], k: int, parts: list[int]
) -> list[mx.array]:
    """restore_order for consecutive runs of `parts[i]` tokens: one (tokens, k, hidden)
    array each, in a block of its own.

    A layer-major prefill hands each of its chunks its rows (generation/prefill/layer_major.py).
    Views of one whole output would share its block, so the model's next op on
    them (mlx-lm's MoE block weighs them by the router's scores) could not write
    in place and would make a second block the size of the call's output.
    Each expert's rows are in slot order (np.nonzero's), so a part's rows of an
    expert are a slice of its output.
    """
    ext = qmm.extension() if qmm.active() else None
    if (
        ext is None
        or not hasattr(ext, "slot_rows")
        or not all(o.dtype == mx.float32 and o.ndim == 2 for o in outs)
    ):
        return split_rows(restore_order(outs, positions, (sum(parts), k)), parts)
    result = []
    lo = 0
    for n in parts:
        hi = lo + n * k
        pieces, where = [], []
        for out, at in zip(outs, positions, strict=True):
            i, j = np.searchsorted(at, [lo, hi])
            if j > i:
                pieces.append(out[int(i) : int(j)])
                where.append(at[i:j] - lo)
        y = ext.slot_rows(pieces, mx.array(np.concatenate(where).astype(np.uint32)), n * k)
        result.append(y.reshape(n, k, y.shape[-1]))
        lo = hi
    return result


def restore_order(
    outs: list[mx.array], positions: list[np.ndarray], shape: tuple[int, ...]
) -> mx.array:
    """Per-expert outputs back in token-slot order, shaped (*shape, hidden).

    On flashserve's kernel one op copies each row to its slot on every core
    (csrc/expert_ops.cpp: slot_rows); else a concatenation and a gather.
    """
    where = np.concatenate(positions)
    ext = qmm.extension() if qmm.active() else None
    if (
        ext is not None
        and hasattr(ext, "slot_rows")  # an extension built before the op has none
        and len(where) == int(np.prod(shape))
        and all(o.dtype == mx.float32 and o.ndim == 2 for o in outs)
    ):
        y = ext.slot_rows(outs, mx.array(where.astype(np.uint32)), len(where))
    else:
        order = np.argsort(where, kind="stable")
        y = mx.concatenate(outs, axis=0)[mx.array(order.astype(np.uint32))]
    return y.reshape(*shape, y.shape[-1])
