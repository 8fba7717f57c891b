"""Layer-major prefill: every chunk of the prompts through one layer before the next.

Chunked prefill (mlx-lm's BatchGenerator) runs a long prompt as a row of full
forward passes, one per `prefill_step_size` tokens. On a model whose weights
come from disk each pass reads every streamed layer and nearly every expert
again, so a 4k-token prompt reads the streamed weights eight times. Here the
order is turned around: layer 0 runs on every chunk, then layer 1, and so on,
so each streamed layer is read once per prefill (`LayerStreamer.holding`),
and each MoE layer makes a single call over the tokens of every chunk, which
reads each needed expert once (experts/prefill.py).

The arithmetic is the chunked prefill's: the same chunks, the same layer
calls with the same inputs, cache states and masks, in an order where each
call still follows the calls it depends on (chunk c of layer l needs layer l's
cache after chunk c - 1, and layer l - 1's output of chunk c). Where the model
folds (generation/prefill/last_token.py), the last token runs in the last chunk, its
rows as prompt rows, as in the batch.

How it runs the model's own code, for any mlx-lm architecture:

* Each chunk runs the model's forward in a greenlet (a coroutine with its own
  stack on the worker thread, so every MLX call stays on that thread).
* While a prefill runs, the model's decoder-layer list holds gates. A gate
  suspends its chunk until the driver's round for that layer, then calls the
  real layer. Whatever the model does between layers runs as written.
* A chunk's forward starts (embedding, masks) before earlier chunks have
  passed every layer, so it gets copies of the caches that report the offset
  at the chunk's start; its gates hand the real cache to the layer.
* While a round's chunks wait at the MoE block (`ExpertOffload.gather`), the
  driver makes one expert call for all of their tokens and hands each chunk
  its rows.
* Held hidden states are bounded by `group_bytes`; beyond it, the chunks run
  in groups, each group layer-major (one read of the streamed weights per group).

A model whose forward does not go through its layer list in order is
refused before anything runs (`LayerMajorUnsupported`): the worker then
prefills it chunk by chunk.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from greenlet import greenlet
from mlx_lm.models.cache import can_trim_prompt_cache

from flashserve.engine.compute import heap, prompt_matmul
from flashserve.engine.experts.prefill import hold_room, release_room
from flashserve.engine.generation.prefill.last_token import past_attention_rows
from flashserve.engine.vision.prompt import real_tokens
from flashserve.engine.weights.layout import layer_list
from flashserve.engine.weights.model import compute_dtype

log = logging.getLogger(__name__)


class LayerMajorUnsupported(Exception):
    """The model's forward cannot be run layer-major (found before any layer ran)."""


@dataclass
class PrefillJob:
    """One prompt: `tokens` run into `cache` (a cache list, advanced in place).

    The last token runs in the last chunk (`LayerMajorPrefill.fold`,
    generation/prefill/last_token.py) or, for a model that does not fold, as a chunk
    of its own, as in chunked prefill; its logits are kept: the first new
    token comes out of this one pass over the weights.
    """

    tokens: list[int]
    cache: list[Any]
    keep_prefix: bool = False  # also keep a copy of the state after tokens[:-1]
    cancelled: Callable[[], bool] = lambda: False
    # A prompt with images: embed(position, tokens) gives a chunk's input embeddings,
    # the images' features merged in (vision/embed.py); `position` is the cache's.
    embed: Callable[[int, list[int]], mx.array] | None = None
    # Results
    logits: mx.array | None = None  # (vocab,) after the last token
    prefix_state: list[Any] | None = None  # the cache after tokens[:-1]
    dropped: bool = False  # cancelled during the prefill: its cache is unusable


@dataclass
class _Chunk:
    job: PrefillJob
    tokens: list[int]
    start: int  # cache offset at the chunk's start
    last: bool = False  # the job's last token
    proxies: dict[int, Any] = field(default_factory=dict)  # id(copy) -> real cache
    copies: list[Any] = field(default_factory=list)  # those copies
    glet: greenlet | None = None
    message: tuple | None = None  # where it waits: ("layer", i) / ("moe", layer, x, ids)
    out: mx.array | None = None  # the last layer's output


@dataclass
class LayerMajorPrefill:
    """Prefills prompts layer-major through one model; see the module doc."""

    model: nn.Module
    layers: list[nn.Module]  # the model's own decoder-layer list
    chunk_tokens: int
    group_bytes: int
    bytes_per_token: int  # held activations per prompt token (hidden states, MoE rows)
    streamer: Any = None  # streaming.streamer.LayerStreamer
    experts: Any = None  # experts.offload.ExpertOffload
    # A layer's float weight copies kept for all its chunks (the memory plan may
    # not leave room for them: then each chunk makes them again, same numbers).
    keep_float_copies: bool = True
    # Asked before each run: (chunk tokens, keep float copies) the memory allows
    # now, or None (generation/memory_guard.py). The tokens are the same in any chunking.
    settings_for: Callable[[], tuple[int, bool] | None] | None = None
    # The last token runs in its prompt's last chunk, as prompt rows (the worker
    # sets it per run: last_token.folds); only its row goes past the last layer.
    fold: bool = False
    _current: _Chunk | None = field(default=None, init=False)  # the chunk running now
    _round: int = field(default=-1, init=False)  # the layer whose round runs
    _main: greenlet | None = field(default=None, init=False)  # the driver's greenlet

    @classmethod
    def for_engine(cls, config: Any, loaded: Any) -> LayerMajorPrefill | None:
        """The engine's layer-major prefill (EngineConfig, LoadedModel), or None: the
        setting is chunked, or every weight is resident."""
        if config.prefill_order != "auto" or (loaded.streamer is None and loaded.experts is None):
            return None
        prefill = cls.for_model(
            loaded.model,
            loaded.config,
            chunk_tokens=config.prefill_step_size,
            group_bytes=config.prefill_group_bytes,
            streamer=loaded.streamer,
            experts=loaded.experts,
        )
        if prefill is not None:
            prefill.keep_float_copies = bool(config.prefill_keep_float_copies)
        return prefill

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        config: dict,
        *,
        chunk_tokens: int,
        group_bytes: int,
        streamer: Any = None,
        experts: Any = None,
    ) -> LayerMajorPrefill | None:
        """The prefill of `model`, or None when its layers are not one list it reads."""
        layers = layer_list(model)
        if layers is None:
            log.info("%s: no layer list to run layer-major", type(model).__module__)
            return None
        text = config.get("text_config") or {}
        hidden = int(config.get("hidden_size") or text.get("hidden_size") or 4096)
        # Held per token: the hidden state, and while an MoE call runs its input
        # and top-k output rows (twice, as they are put back in order).
        per_token = 2 * hidden
        if experts is not None:
            top_k = max(info.top_k for info in experts.layers.values())
            per_token += (2 * top_k + 1) * hidden
        return cls(
            model,
            layers,
            chunk_tokens=chunk_tokens,
            group_bytes=group_bytes,
            bytes_per_token=per_token * compute_dtype().size,
            streamer=streamer,
            experts=experts,
        )

    def run(self, jobs: list[PrefillJob]) -> None:
        """Run every job's tokens into its cache. Raises what a layer raises."""
        if self.settings_for is not None and (chosen := self.settings_for()) is not None:
            self.chunk_tokens, self.keep_float_copies = chosen
        for group in self._groups(jobs):
            self._run_group(group)
        if self.experts is None:
            heap.trim()  # the arenas' copies of the chunks' activations (compute/heap.py)

    def _groups(self, jobs: list[PrefillJob]) -> list[list[_Chunk]]:
        """The jobs' chunks, in groups that fit the budget (a long job spans groups)."""
        per_group = max(self.group_bytes // max(self.bytes_per_token, 1), 1)
        per_group = max(per_group // self.chunk_tokens, 1) * self.chunk_tokens
        groups: list[list[_Chunk]] = [[]]
        room = per_group
        for job in jobs:
            base = _offset(job.cache)
            body = len(job.tokens) - 1
            end = len(job.tokens) if self.fold else body
            cuts = [
                (pos, min(pos + self.chunk_tokens, end)) for pos in range(0, end, self.chunk_tokens)
            ]
            if job.keep_prefix and body > 0:
                job.prefix_state = [None] * len(job.cache)
            for a, b in cuts if self.fold else [*cuts, (body, body + 1)]:
                if room < b - a:
                    groups.append([])
                    room = per_group
                groups[-1].append(_Chunk(job, job.tokens[a:b], base + a, last=b > body))
                room -= b - a
        return [g for g in groups if g]

    # -- one group ------------------------------------------------------------------

    def _run_group(self, chunks: list[_Chunk]) -> None:
        for chunk in chunks:
            proxies = [_proxy(c, chunk.start) for c in chunk.job.cache]
            chunk.proxies = {id(p): c for p, c in zip(proxies, chunk.job.cache, strict=True)}
            chunk.copies = proxies
            chunk.glet = greenlet(_forward(self.model, chunk, proxies))
        gates = [_Gate(self, i, layer) for i, layer in enumerate(self.layers)]
        self._main = greenlet.getcurrent()
        self.layers[:] = gates
        if self.experts is None:
            heap.enter_prefill()  # its activations' blocks reused, not faulted in afresh
        else:
            self.experts.gather = self._gather
            starts: dict[int, int] = {}  # per prompt: where its first chunk starts
            for c in chunks:
                starts[id(c.job)] = min(starts.get(id(c.job), c.start), c.start)
            tokens = sum(len(c.tokens) for c in chunks)
            held = tokens * self.bytes_per_token
            hold_room(self.experts, tokens, self.chunk_tokens, sum(starts.values()), held)
        try:
            self._start(chunks)
            for index in range(len(gates)):
                chunks = self._drop_cancelled(chunks)
                self._layer_round(index, chunks)
        finally:
            self.layers[:] = [g.layer for g in gates]
            if self.experts is None:
                heap.leave_prefill()
            else:
                self.experts.gather = None
                release_room(self.experts)
            for chunk in chunks:
                if chunk.glet is not None and not chunk.glet.dead:
                    chunk.glet.throw()  # unwinds its forward; nothing is left suspended
            self._current = None
            self._round = -1

    def _start(self, chunks: list[_Chunk]) -> None:
        """Each chunk runs its forward up to the first layer (embedding, masks)."""
        for chunk in chunks:
            self._resume(chunk)
            if chunk.message != ("layer", 0):
                raise LayerMajorUnsupported(
                    f"{type(self.model).__module__}: the forward does not start at "
                    f"decoder layer 0 of its layer list (got {chunk.message!r})"
                )
            # The masks are made: the copies' arrays would keep a restored prefix's
            # KV alive beside the cache it grows into, to the chunk's last layer.
            for copy_ in chunk.copies:
                if type(copy_).__name__ in _PLAIN_KV:
                    copy_.keys = copy_.values = None

    def _layer_round(self, index: int, chunks: list[_Chunk]) -> None:
        self._round = index
        streamed = self.streamer is not None and index in self.streamer.streamed_layers
        with self.streamer.holding(index) if streamed else nullcontext():
            keep = prompt_matmul.keep_dequantized() if self.keep_float_copies else nullcontext()
            with keep:  # each float copy once per round, not per chunk
                for chunk in chunks:
                    if chunk.last and chunk.job.prefix_state is not None and not self.fold:
                        _snapshot(chunk.job, index)
                    self._resume(chunk)
                    if chunk.last and chunk.job.prefix_state is not None and self.fold:
                        _snapshot(chunk.job, index, trim=1)  # the last token ran with it
            waiting = [c for c in chunks if c.message is not None and c.message[0] == "moe"]
            while waiting:
                self._merged_moe(waiting)
                waiting = [c for c in waiting if c.message is not None and c.message[0] == "moe"]
            want = ("layer", index + 1) if index + 1 < len(self.layers) else None
            for chunk in chunks:
                if chunk.message != want:
                    raise RuntimeError(
                        f"layer-major prefill: after layer {index} a chunk waits at "
                        f"{chunk.message!r}, expected {want!r}"
                    )
            mx.eval([c.out for c in chunks], [_state(c.job.cache, index) for c in chunks])

    def _merged_moe(self, waiting: list[_Chunk]) -> None:
        """One expert call for the MoE inputs of every waiting chunk; each gets its rows."""
        layer = waiting[0].message[1]
        if any(c.message[1] != layer for c in waiting):
            raise RuntimeError("layer-major prefill: chunks wait at different MoE layers")
        xs = [c.message[2] for c in waiting]
        ids = [c.message[3] for c in waiting]
        hidden = xs[0].shape[-1]
        k = ids[0].shape[-1]
        x_all = mx.concatenate([x.reshape(-1, hidden) for x in xs])[None]
        ids_all = mx.concatenate([i.reshape(-1, k) for i in ids])[None]
        # One array per chunk, each in a block of its own (not views of one output):
        # the model's next op (mlx-lm weighs the rows by the router's scores) then
        # writes in place instead of making a second block of the call's size.
        ys = self.experts.run_prefill(layer, x_all, ids_all, parts=[i.size // k for i in ids])
        for chunk, i, y in zip(waiting, ids, ys, strict=True):
            self._resume(chunk, y.reshape(*i.shape, y.shape[-1]))

    def _gather(self, layer: int, x: mx.array, indices: mx.array) -> mx.array:
        """ExpertOffload.gather while a prefill runs: wait for the round's merged call."""
        assert self._main is not None
        return self._main.switch(("moe", layer, x, indices))

    def _resume(self, chunk: _Chunk, *value: Any) -> None:
        assert chunk.glet is not None
        self._current = chunk
        message = chunk.glet.switch(*value)
        chunk.message = None if chunk.glet.dead else message

    def _drop_cancelled(self, chunks: list[_Chunk]) -> list[_Chunk]:
        keep = []
        for chunk in chunks:
            job = chunk.job
            if job.dropped or job.cancelled():
                job.dropped = True
                if chunk.glet is not None and not chunk.glet.dead:
                    chunk.glet.throw()
                continue
            keep.append(chunk)
        return keep


class _Gate:
    """Stands in for decoder layer `index` while a prefill runs; see the module doc."""

    def __init__(self, driver: LayerMajorPrefill, index: int, layer: nn.Module) -> None:
        self.driver = driver
        self.index = index
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        # What the forward reads from its layers (`is_linear`, `use_sliding`, ...)
        return getattr(self.layer, name)

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        driver = self.driver
        assert driver._main is not None
        driver._main.switch(("layer", self.index))  # back here in this layer's round
        chunk = driver._current
        assert chunk is not None and driver._round == self.index
        args = tuple(chunk.proxies.get(id(a), a) for a in args)
        kwargs = {k: chunk.proxies.get(id(v), v) for k, v in kwargs.items()}
        # Folding, a layer's rows are prompt rows whatever the chunk's size (a dense
        # layer's call does not switch greenlets: the block is one chunk's).
        tail = driver.fold and chunk.last and self.index == len(driver.layers) - 1
        width = h.shape[1] if tail and isinstance(h, mx.array) and h.ndim == 3 else 0
        with (
            prompt_matmul.prompt_rows() if driver.fold else nullcontext(),
            past_attention_rows(self.layer, [width - 1] * h.shape[0], width)
            if width
            else nullcontext(),
        ):
            chunk.out = self.layer(h, *args, **kwargs)
        out = chunk.out
        if tail and isinstance(out, mx.array) and out.ndim == 3:
            return out[:, -1:]  # only the last token's row goes on to the LM head
        return out


def _forward(model: nn.Module, chunk: _Chunk, cache: list[Any]) -> Callable[[], None]:
    embed = chunk.job.embed

    def run() -> None:
        if embed is None:
            logits = model(mx.array([chunk.tokens]), cache=cache)
        else:
            inputs = mx.array([real_tokens(chunk.tokens)])
            logits = model(inputs, cache=cache, input_embeddings=embed(chunk.start, chunk.tokens))
        if chunk.last:  # other chunks' logits stay lazy: never computed
            chunk.job.logits = logits[0, -1]

    return run


def _snapshot(job: PrefillJob, index: int, trim: int = 0) -> None:
    """Keep layer `index`'s state after tokens[:-1]: taken before its last token runs,
    or after, cut back by `trim` (a folded last token: its caches can be trimmed)."""
    assert job.prefix_state is not None
    if index < len(job.cache):
        state = copy.deepcopy(job.cache[index])
        if trim:
            if not can_trim_prompt_cache([state]):
                job.prefix_state = None  # a sliding window that filled: nothing exact to keep
                return
            state.trim(trim)
        mx.eval(_state([state], 0))
        job.prefix_state[index] = state


# Caches whose copies hold nothing after the masks are made but their arrays
# (mlx-lm's, and kv/cache.py's quantized one): the gates hand layers the real cache.
_PLAIN_KV = ("KVCache", "QuantizedKVCache", "QuantizedSeqKVCache")


def _offset(cache: list[Any]) -> int:
    for c in cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0


def _proxy(cache: Any, offset: int) -> Any:
    """A shallow copy of `cache` that reports `offset` (what the forward's masks read)."""
    proxy = copy.copy(cache)
    if isinstance(getattr(cache, "offset", None), int):
        try:
            proxy.offset = offset
        except AttributeError as exc:
            raise LayerMajorUnsupported(f"{type(cache).__name__}: offset is read-only") from exc
    return proxy


def _state(cache: list[Any], index: int) -> Any:
    if index >= len(cache):  # models that share caches between layers have fewer
        return []
    try:
        return cache[index].state
    except Exception:  # an empty cache of some kinds raises
        return []
