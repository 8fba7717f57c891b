"""M-RoPE: Qwen's three-part positions, given to mlx-lm's language model.

Qwen's vision-language models give an image's tokens a position in three
parts (time, row, column: the image's start plus its token's t, h, w) and
the text after an image the position after the image's largest, not after
its last token: past an image of h x w tokens the positions run
h*w - max(h, w) behind the token count (the rope delta). mlx-vlm computes
them (its language model's get_rope_index, vision/tower.py calls it);
mlx-lm's language model, which flashserve runs, rotates a token by its
index, `offset` + i, where `offset` is the cache's. The positions therefore
travel where mlx-lm passes positions, the cache's offset:

- A prompt with images is prefilled by flashserve (generation/prefill/alone.py
  and prefill.py, through vision/embed.py). `place` makes each attention
  cache's offset a RopeOffset: still the int mlx-lm reads and writes, which
  also carries the prompt's positions and stays one as the cache grows.
  `MRope`, installed over each attention's rope, rotates a call's rows at
  their positions: text at its position by mlx-lm's own rope (one call per
  run), image tokens by mlx-vlm's M-RoPE (the model's own section layout),
  tokens past the prompt at offset + delta. Which way a token goes is a
  function of its index alone, so a prompt gives the same keys in any
  chunking, with a cached prefix or cold.
- In the batch (mlx-lm's BatchKVCache) the offset is an array per sequence
  that only RoPE reads. Each cache the worker inserts merges with `_merge`,
  which adds its sequence's delta to that array as the sequence joins;
  filtering, extending and speculative rollback keep it, so every decode step
  (compiled or not) rotates at offset + delta.
- The prompt cache keeps states whose offsets are plain again; the next
  turn's prefill places its own prompt's positions (the images are its own).

Qwen3-VL's deepstack rides on the same positions: a chunk's image rows from
the tower's inner layers wait on them (vision/embed.py puts them there) until
the first decoder layers add them (`install_deepstack`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache


class Positions:
    """A prompt's M-RoPE positions (3, L), as runs: text with consecutive positions
    (one mlx-lm rope call each) and image tokens (mlx-vlm's M-RoPE)."""

    def __init__(self, table: np.ndarray) -> None:
        self.length = int(table.shape[1])
        # As mlx-vlm's get_rope_index: positions past the prompt are offset + delta.
        self.delta = int(table.max()) + 1 - self.length if self.length else 0
        self.table = mx.array(table[:, None, :].astype(np.int32))  # (3, 1, L)
        # Qwen3-VL: a chunk's deepstack rows by its start, (each row's place, each
        # deepstack layer's image rows + a zero row): put by vision/embed.py, taken
        # by the layers install_deepstack gave the step.
        self.deepstack: dict[int, tuple[mx.array, list[mx.array]]] = {}
        self.first = table[0].tolist()  # a text token's one position
        # A token is text where its three positions agree; a text run goes on while
        # they count up by one (the text after an image starts past its largest).
        plain = (table[0] == table[1]) & (table[1] == table[2])
        starts = np.ones(self.length, dtype=bool)
        starts[1:] = (plain[1:] != plain[:-1]) | (plain[1:] & (table[0, 1:] != table[0, :-1] + 1))
        cuts = [*np.flatnonzero(starts).tolist(), self.length]
        # [start, end), text or not
        self.runs = [(a, b, bool(plain[a])) for a, b in itertools.pairwise(cuts)]

    def rotate(self, mrope: MRope, x: mx.array, offset: int) -> mx.array:
        """x's rows (tokens offset .. offset + L) rotated at their positions."""
        end = offset + x.shape[-2]
        pieces = []
        for start, stop, text in self.runs:
            lo, hi = max(start, offset), min(stop, end)
            if lo >= hi:
                continue
            rows = x[..., lo - offset : hi - offset, :]
            if text:
                pieces.append(mrope.rope(rows, offset=self.first[lo]))
            else:
                rotated, _ = mrope.rotary.apply_rotary(rows, rows, self.table[:, :, lo:hi])
                pieces.append(rotated)
        if end > self.length:  # past the prompt: the decode's positions
            lo = max(offset, self.length)
            pieces.append(mrope.rope(x[..., lo - offset :, :], offset=lo + self.delta))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-2)


class RopeOffset(int):
    """A cache's offset, the int mlx-lm reads, carrying its prompt's Positions."""

    positions: Positions

    def __new__(cls, value: int, positions: Positions) -> RopeOffset:
        out = super().__new__(cls, value)
        out.positions = positions
        return out

    # Subtracting gives a plain int (int's own __sub__): a cache trimmed back
    # (`offset -= n`), as the prompt cache trims a state to another prompt's common
    # prefix, no longer carries positions that were its old prompt's.

    def __add__(self, other: Any) -> Any:
        # The cache grows by `offset += n`: still the prompt's.
        if type(other) is int:
            return RopeOffset(int(self) + other, self.positions)
        return int(self) + other

    __radd__ = __add__

    def __copy__(self) -> RopeOffset:
        return self  # immutable: copies of a cache share it

    def __deepcopy__(self, memo: dict) -> RopeOffset:
        return self

    def __reduce__(self) -> tuple:
        return (int, (int(self),))  # anything serialized sees a plain offset

    @property
    def delta(self) -> int:
        """What the batch adds to this sequence's offset (past the prompt's end)."""
        return self.positions.delta if self >= self.positions.length else 0


class MRope(nn.Module):
    """An attention's rope: mlx-lm's, and the prompt's positions where its cache has them."""

    def __init__(self, rope: nn.Module, rotary: Any) -> None:
        super().__init__()
        # Underscored: neither is a parameter, and weights loaded by name skip them.
        self._rope, self._rotary = rope, rotary

    @property
    def rope(self) -> nn.Module:
        return self._rope

    @property
    def rotary(self) -> Any:
        return self._rotary

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if isinstance(offset, RopeOffset):
            return offset.positions.rotate(self, x, int(offset))
        return self._rope(x, offset=offset)  # the batch's offsets hold the deltas


def install(layers: Sequence[nn.Module], rotary: Any) -> int:
    """Put MRope over each attention's rope in `layers`; how many attentions took it."""
    count = 0
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        rope = getattr(attention, "rope", None)
        if rope is None:
            continue  # a linear-attention layer (gated delta-net): no positions
        if not isinstance(rope, MRope):
            attention.rope = MRope(rope, rotary)
        count += 1
    return count


def install_deepstack(layers: Sequence[nn.Module], count: int) -> None:
    """Qwen3-VL's deepstack: after each of the first `count` decoder layers, a prompt
    chunk's image rows get that layer's part of their deepstack features added (as
    mlx-vlm's language model does). The layers' class gains the step (the instance
    keeps its weights and their names); the chunk's rows come with its cache's
    positions, so a layer without them (a decode step) runs as it was."""
    taking = layers[:count]
    for index, layer in enumerate(taking):
        if not isinstance(layer, _Deepstack):
            layer.__class__ = _deepstack_class(type(layer))
        layer._deepstack_index = index
        layer._deepstack_last = index == len(taking) - 1  # drops the chunk's rows


class _Deepstack:
    _deepstack_index = 0
    _deepstack_last = False

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        out = super().__call__(x, mask, cache)  # type: ignore[misc]
        offset = getattr(cache, "offset", None)
        if not isinstance(offset, RopeOffset):
            return out
        start = int(offset) - x.shape[1]  # the layer's attention took the chunk
        entry = offset.positions.deepstack.get(start)
        if entry is None:
            return out
        places, parts = entry
        if self._deepstack_last:
            del offset.positions.deepstack[start]  # its last use
        # Each row adds its image row's part, a text row the zero row: out as it was.
        return out + parts[self._deepstack_index][places][None]


_DEEPSTACK_CLASSES: dict[type, type] = {}


def _deepstack_class(cls: type) -> type:
    if cls not in _DEEPSTACK_CLASSES:
        _DEEPSTACK_CLASSES[cls] = type(f"Deepstack{cls.__name__}", (_Deepstack, cls), {})
    return _DEEPSTACK_CLASSES[cls]


def _positional(cache: Any) -> bool:
    return isinstance(cache, (KVCache, QuantizedKVCache))


def place(cache: list[Any], positions: Positions) -> None:
    """Give each attention cache of a prompt's `cache` the prompt's positions."""
    for c in cache:
        if _positional(c):
            c.offset = RopeOffset(int(c.offset), positions)


def joining(cache: list[Any]) -> list[Any]:
    """`cache` made to merge into a batch with its rope delta (in place)."""
    for c in cache:
        if _positional(c):
            # An instance attribute: mlx-lm merges a batch's caches through the
            # first sequence's `merge`, and every sequence joining carries this one.
            c.merge = _merge
    return cache


def _merge(caches: list[Any]) -> Any:
    batch = type(caches[0]).merge(caches)
    deltas = [c.offset.delta if isinstance(c.offset, RopeOffset) else 0 for c in caches]
    if any(deltas):
        shift = mx.array(deltas)
        for part in getattr(batch, "parts", None) or [batch]:  # kv_bits: three parts
            part.offset = part.offset + shift
    return batch
