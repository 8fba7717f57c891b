"""A decode step of a resident model as one compiled MLX function.

On MLX's CPU backend a decode step of the default model is ~850 graph
nodes, and Python builds every one of them each step through mlx-lm's
modules: ~2 ms of a ~10 ms step, on a core the quantized matmuls want
(issue 22). `mx.compile` records the step once and replays it from C++.

mlx-lm's BatchKVCache cannot be traced as it is: it writes and slices its
buffers at a Python int (`_idx`), so a recorded step would keep writing at
the position it was traced at. Inside the compiled function each layer's
cache is a `_TracedCache` instead: the same buffers, written at a position
given as an array, and handed to attention whole, with a mask that admits
the keys a BatchKVCache would have returned (left padding to the newest
key). Attention skips keys that no row may see at the end of the buffer
(compute/csrc/step_sdpa.cpp), so it sees the same keys in the same chunks
as the uncompiled step: the outputs are bit-identical. The BatchKVCache
objects stay the state of record; the step writes its buffers, offsets and
`_idx` back, so mlx-lm's batching (insert, filter, extract) and the prompt
cache keep working on them unchanged.

With `kv_bits` each layer's cache is a QuantizedBatchKVCache: three
BatchKVCaches (packed integers, scales, biases), traced alike as six buffers
(`_TracedQuantCache`): the new token's keys and values are quantized and
written into them at the array position, and attention reads the packed
buffers whole (compute/csrc/step_sdpa_quant.cpp leaves out the masked tail
as the float kernel does), so these steps too are the uncompiled ones to the
bit.

A step is compiled only when its result cannot depend on anything else
that changes: every weight resident (no expert cache, no split across
ranks; under a layer streamer, while no layer streams: the memory plan's
loan can hold every layer), one new token per sequence, BatchKVCache layers
(or kv_bits' QuantizedBatchKVCache). A trace holds the weights it was
traced with, so the traces go whenever the streamer's layers change (a
layer lent, given back or shed): their memory goes back with the layer.
Other calls go to the model as they are. A trace is kept per input shape
(batch size, buffer capacity: it grows by mlx-lm's 256 keys) and per state
of the switches that decide which ops a step is built from; the least
recently used go past MAX_TRACES.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache

from flashserve.engine.compute import prompt_matmul, qmm, step_ops
from flashserve.engine.kv import cache as kv_cache
from flashserve.engine.kv.cache import QuantizedBatchKVCache
from flashserve.engine.speculative.mlx_lm_internals import (
    right_padding_pending,
    set_write_position,
    write_position,
)

log = logging.getLogger(__name__)


class _TracedCache:
    """One layer's BatchKVCache inside the compiled step: written at an array position."""

    def __init__(
        self, keys: mx.array, values: mx.array, offset: mx.array, at: mx.array, mask: mx.array
    ) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.at = at  # (1,) int32: the write position, BatchKVCache's _idx
        self.mask = mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = step_ops.cache_write(self.keys, keys, self.at)
        self.values = step_ops.cache_write(self.values, values, self.at)
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        del n, return_array  # one query row; always an array
        if kwargs.get("window_size") is not None:
            # A sliding window kept by the mask alone: not this mask. The
            # trace fails and the model decodes uncompiled.
            raise ValueError("a windowed attention mask")
        return self.mask


class _TracedQuantCache(_TracedCache):
    """One layer's QuantizedBatchKVCache inside the compiled step: its three parts'
    buffers (packed integers, scales, biases; keys and values), written at an array
    position. `bits` sends mlx-lm's attention to the quantized SDPA (kv/cache.py)."""

    def __init__(
        self,
        buffers: list[mx.array],
        offset: mx.array,
        at: mx.array,
        mask: mx.array,
        group_size: int,
        bits: int,
    ) -> None:
        super().__init__(buffers[0::2], buffers[1::2], offset, at, mask)  # type: ignore[arg-type]
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        # Packed uint32 parts go through slice_update (in place, as cache_write, when
        # the buffer is donated); cache_write takes the float32 scales and biases.
        self.keys = [
            step_ops.cache_write(b, x, self.at) for b, x in zip(self.keys, qk, strict=True)
        ]
        self.values = [
            step_ops.cache_write(b, x, self.at) for b, x in zip(self.values, qv, strict=True)
        ]
        self.offset = self.offset + keys.shape[2]
        return tuple(self.keys), tuple(self.values)

    def buffers(self) -> list[mx.array]:
        """The six buffers in the order they came in: each part's keys, then values."""
        return [a for k, v in zip(self.keys, self.values, strict=True) for a in (k, v)]


def _parts(c: Any) -> list[BatchKVCache]:
    """The BatchKVCaches a layer's cache keeps: itself, or a quantized cache's three."""
    return c.parts if isinstance(c, QuantizedBatchKVCache) else [c]


def _layout(cache: list[Any]) -> tuple[tuple[int, int] | None, ...]:
    """Per layer: None for a float cache, (group size, bits) for a quantized one."""
    return tuple(
        (c.group_size, c.bits) if isinstance(c, QuantizedBatchKVCache) else None for c in cache
    )


def switches() -> tuple[bool, ...]:
    """What decides which ops a step is built from: a trace is kept per state."""
    return (qmm.active(), step_ops.active(), qmm.fusion(), kv_cache.packed_attention())


# Traces kept, one per (switches, batch size, buffer capacity), least recently
# used dropped first. A trace holds ~850 graph nodes without data; a long
# conversation passes a new capacity every 256 tokens, and only the latest
# few are used again.
MAX_TRACES = 16


class CompiledDecode:
    """The model as BatchGenerator calls it: decode steps compiled, anything else as it is."""

    def __init__(self, model: nn.Module, streamer: Any = None) -> None:
        self.model = model
        self._fns: dict[tuple, Callable[..., list[mx.array]]] = {}  # in order of use
        self.failed = False  # a trace failed: this model decodes uncompiled from then on
        self.steps = 0  # compiled steps run (tests check the path was taken)
        self.streamer = streamer  # a LayerStreamer: compiled only while no layer streams
        if streamer is not None:  # the latest batch's; weak: a dropped batch frees its traces
            me = weakref.ref(self)
            streamer.residency_listeners["compiled decode"] = lambda: _forget(me())

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this object lacks: layers, make_cache, args...
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> mx.array:
        # Only flashserve's attention leaves the buffer's unused tail out; MLX's
        # would attend over it, masked, and round differently.
        streams = self.streamer is not None and self.streamer.streamed_layers
        plain = kwargs or streams or self.failed or not step_ops.active()
        # A prompt's last token (generation/prefill/last_token.py) runs as prompt rows, uncompiled.
        plain = plain or prompt_matmul.all_prompt_rows()
        if plain or not _eligible(inputs, cache):
            return self.model(inputs, cache=cache, **kwargs)
        assert cache is not None
        try:
            return self._compiled(inputs, cache)
        except Exception as exc:  # any model the trace cannot take: it decodes as before
            self.failed = True
            log.warning("decode step not compiled for this model (%s); running it uncompiled", exc)
            return self.model(inputs, cache=cache)

    def _compiled(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        first = _parts(cache[0])[0]
        idx = write_position(first)
        for c in cache:
            _make_room(c, inputs.shape[0])
        capacity = first.keys.shape[2]
        # BatchKVCache's own mask for this step (left padding to the new key),
        # widened to the whole buffer: keys past the new one hidden from every row.
        mask = cache[0].make_mask(1, return_array=True)
        widths = [(0, 0)] * (mask.ndim - 1) + [(0, capacity - mask.shape[-1])]
        mask = mx.pad(mask, widths, constant_values=False)
        at = mx.array([idx], dtype=mx.int32)
        # Every layer has taken the same tokens (BatchGenerator updates them
        # alike), so their offsets are equal: one array serves them all, and
        # the trace computes the next one once instead of once per layer.
        state = [first.offset] + [a for c in cache for p in _parts(c) for a in (p.keys, p.values)]
        layout = _layout(cache)
        key = (*switches(), inputs.shape[0], capacity, layout)
        fn = self._fns.pop(key, None)
        if fn is None:
            fn = mx.compile(lambda *args: self._step(layout, *args))
            if len(self._fns) >= MAX_TRACES:
                del self._fns[next(iter(self._fns))]  # the least recently used
        self._fns[key] = fn  # now the most recently used
        logits, offset, *new = fn(inputs, at, mask, state)
        parts = [p for c in cache for p in _parts(c)]
        for i, p in enumerate(parts):
            # The old buffers' last reference goes here, so the step's slice
            # updates write in place when it runs, as BatchKVCache's do.
            p.keys, p.values = new[2 * i : 2 * i + 2]
            p.offset = offset
            set_write_position(p, idx + inputs.shape[1])
        self.steps += 1
        return logits

    def _step(
        self,
        layout: tuple[tuple[int, int] | None, ...],
        inputs: mx.array,
        at: mx.array,
        mask: mx.array,
        state: list[mx.array],
    ) -> list[mx.array]:
        offset, buffers = state[0], state[1:]
        caches: list[_TracedCache] = []
        i = 0
        for quantized in layout:
            if quantized is None:
                caches.append(_TracedCache(buffers[i], buffers[i + 1], offset, at, mask))
                i += 2
            else:
                caches.append(_TracedQuantCache(buffers[i : i + 6], offset, at, mask, *quantized))
                i += 6
        out = [self.model(inputs, cache=caches), caches[0].offset]
        for c in caches:
            out += c.buffers() if isinstance(c, _TracedQuantCache) else [c.keys, c.values]
        return out


def _forget(compiled: CompiledDecode | None) -> None:
    if compiled is not None:
        compiled._fns.clear()


def _eligible(inputs: mx.array, cache: list[Any] | None) -> bool:
    """One new token per sequence over plain (or kv_bits') BatchKVCache layers at one position."""
    if not cache or inputs.ndim != 2 or inputs.shape[1] != 1:
        return False
    if not all(type(c) in (BatchKVCache, QuantizedBatchKVCache) for c in cache):
        return False
    parts = [p for c in cache for p in _parts(c)]
    if any(p.keys is None for p in parts):
        return False
    idx = write_position(parts[0])
    return all(write_position(p) == idx and not right_padding_pending(p) for p in parts)


def _make_room(c: Any, batch: int) -> None:
    """Grow a layer's buffers for one more key the way BatchKVCache does, if they are full.

    Through its own update_and_fetch (a zero key, taken back with trim), so
    mlx-lm keeps deciding how buffers grow.
    """
    first = _parts(c)[0]
    if write_position(first) < first.keys.shape[2]:
        return
    k, v = first.keys, first.values
    # A quantized cache's first part holds packed integers: 32 / bits values a word.
    quantized = isinstance(c, QuantizedBatchKVCache)
    per_word = 32 // c.bits if quantized else 1
    dtype = c.parts[1].keys.dtype if quantized else k.dtype  # the scales': the compute dtype
    c.update_and_fetch(
        mx.zeros((batch, k.shape[1], 1, k.shape[3] * per_word), dtype),
        mx.zeros((batch, v.shape[1], 1, v.shape[3] * per_word), dtype),
    )
    c.trim(1)


def for_model(
    model: nn.Module, *, compile: bool, streamer: Any = None
) -> nn.Module | CompiledDecode:
    """The model BatchGenerator should call: compiled decode steps if `compile` (CPU only).

    The caller says whether compiling is safe: nothing swapped or routed in
    Python between steps but `streamer`'s layers (compiled only while none
    streams).
    """
    if not compile or mx.default_device() != mx.cpu:
        return model
    return CompiledDecode(model, streamer)
