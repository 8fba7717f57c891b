"""One rank's share of the model: its layer range runs, the rest are stubs.

Every rank runs the model's own forward, so any architecture whose decoder
layers are one list works (the same condition as layer-major prefill). In the
model's layer list:

* an owned layer runs as loaded (resident, streamed, experts offloaded). The
  first owned layer of ranks > 0 first receives the hidden state from the
  rank before; the last owned layer sends its output on: to the next rank,
  or from the last rank back to rank 0;
* a layer outside the range is a stub that returns its input. Its weights are
  dropped. It still advances its KV cache by the chunk's length with
  zero-width keys: masks and offsets are computed from caches (often layer
  0's), which must say the same on every rank, while no memory is spent;
* on rank 0 the stub of the last layer receives the final hidden state from
  the last rank, so rank 0's norm and LM head see what one process would.

Send and receive are evaluated at once, and the layer's input is evaluated
before: each rank then issues its collectives in the forward's order, and the
previous step's token broadcast (mirror.py), which the input depends on,
comes before this step's transfers on every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from flashserve.engine.weights.layout import find_layers, layer_list
from flashserve.engine.weights.model import ModelLoadError

log = logging.getLogger(__name__)


@dataclass
class TransferStats:
    """Time spent in hidden-state transfers: blocked in send or receive, which
    includes waiting for the other ranks' layers to finish."""

    seconds: float = 0.0
    transfers: int = 0
    bytes: int = 0
    steps: int = 0  # batch steps (decode or prefill) run through the pipeline
    last_step_seconds: float = 0.0
    _step_start: float = 0.0

    def add(self, seconds: float, nbytes: int) -> None:
        self.seconds += seconds
        self.transfers += 1
        self.bytes += nbytes

    def begin_step(self) -> None:
        self._step_start = self.seconds

    def end_step(self) -> None:
        self.steps += 1
        self.last_step_seconds = self.seconds - self._step_start

    def to_dict(self) -> dict[str, float]:
        return {
            "transfer_seconds_total": self.seconds,
            "transfers_total": self.transfers,
            "transfer_bytes_total": self.bytes,
            "steps_total": self.steps,
            "last_step_transfer_seconds": self.last_step_seconds,
            "transfer_seconds_per_step": self.seconds / self.steps if self.steps else 0.0,
        }


@dataclass
class _Link:
    group: Any  # mx.distributed.Group
    stats: TransferStats

    def receive(self, h: mx.array, source: int) -> mx.array:
        mx.eval(h)
        start = time.perf_counter()
        out = mx.distributed.recv_like(h, source, group=self.group)
        mx.eval(out)
        self.stats.add(time.perf_counter() - start, out.nbytes)
        return out

    def send(self, h: mx.array, dest: int) -> mx.array:
        mx.eval(h)
        start = time.perf_counter()
        sent = mx.distributed.send(h, dest, group=self.group)
        mx.eval(sent)
        self.stats.add(time.perf_counter() - start, h.nbytes)
        return h


class _Owned:
    """An owned layer, with the transfers at the range's edges."""

    def __init__(
        self, layer: Any, link: _Link, receive_from: int | None, send_to: int | None
    ) -> None:
        self.layer = layer
        self.link = link
        self.receive_from = receive_from
        self.send_to = send_to

    def __getattr__(self, name: str) -> Any:
        # What the forward or make_cache reads from its layers (is_linear, use_sliding...)
        return getattr(self.layer, name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if self.receive_from is not None:
            h = self.link.receive(h, self.receive_from)
        out = self.layer(h, *args, **kwargs)
        if self.send_to is not None:
            out = self.link.send(out, self.send_to)
        return out


class _Skipped:
    """A layer another rank runs: passes its input on; see the module doc."""

    def __init__(self, layer: Any, link: _Link, receive_from: int | None) -> None:
        self.layer = layer  # its weights dropped; kept for its attributes
        self.link = link
        self.receive_from = receive_from

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if cache is not None and hasattr(cache, "update_and_fetch"):
            empty = mx.zeros((h.shape[0], 1, h.shape[1], 0), dtype=h.dtype)
            cache.update_and_fetch(empty, empty)
        if self.receive_from is not None:
            return self.link.receive(h, self.receive_from)
        return h


@dataclass
class Pipeline:
    """What `install` did on this rank."""

    rank: int
    size: int
    ranges: list[range]
    num_layers: int
    owned_weight_bytes: int  # weights of this rank's layers (resident ones)
    dropped_weight_bytes: int  # weights of other ranks' layers, freed here
    stats: TransferStats

    @property
    def layers(self) -> range:
        return self.ranges[self.rank]


def install(model: nn.Module, group: Any, ranges: list[range]) -> Pipeline:
    """Make `model` run this rank's share of the pipeline (in place)."""
    layers = _layer_list(model)
    rank, size = group.rank(), group.size()
    if len(layers) != ranges[-1].stop:
        raise ModelLoadError(
            f"the layer split covers {ranges[-1].stop} layers, the model has {len(layers)}"
        )
    mine = ranges[rank]
    stats = TransferStats()
    link = _Link(group, stats)
    last = len(layers) - 1
    owned_bytes = dropped_bytes = 0
    for i, layer in enumerate(layers):
        if i in mine:
            owned_bytes += _weight_bytes(layer)
            receive_from = rank - 1 if i == mine.start and rank > 0 else None
            send_to = None
            if i == mine.stop - 1 and size > 1:
                send_to = rank + 1 if rank < size - 1 else 0
            layers[i] = _Owned(layer, link, receive_from, send_to)
        else:
            dropped_bytes += _drop_weights(layer)
            receive_from = size - 1 if rank == 0 and i == last else None
            layers[i] = _Skipped(layer, link, receive_from)
    mx.clear_cache()
    log.info(
        "rank %d of %d runs layers %d-%d of %d (%.1f MB of layer weights; %.1f MB dropped)",
        rank,
        size,
        mine.start,
        mine.stop - 1,
        len(layers),
        owned_bytes / 1e6,
        dropped_bytes / 1e6,
    )
    return Pipeline(rank, size, ranges, len(layers), owned_bytes, dropped_bytes, stats)


def num_layers(model: nn.Module) -> int:
    return len(_layer_list(model))


def _layer_list(model: nn.Module) -> list[Any]:
    """The list object the model keeps its decoder layers in."""
    layers = layer_list(model)
    if layers is None:
        find_layers(model)  # its reason, where it has one
        raise ModelLoadError(
            f"{type(model).__module__}: its decoder layers are not one list; "
            "it cannot be split across ranks"
        )
    return layers


def _weight_bytes(layer: Any) -> int:
    if not isinstance(layer, nn.Module):
        return 0
    return sum(p.nbytes for _, p in tree_flatten(layer.parameters()))


def _drop_weights(layer: Any) -> int:
    """Free a layer's weights, keeping the module (the forward reads its attributes)."""
    if not isinstance(layer, nn.Module):
        return 0
    nbytes = _weight_bytes(layer)
    layer.update(tree_map(lambda p: mx.zeros((0,), dtype=p.dtype), layer.parameters()))
    return nbytes
