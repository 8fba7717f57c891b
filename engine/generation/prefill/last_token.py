"""A prompt's last token in its last chunk: the first new token without a step of its own.

mlx-lm prefills a prompt but its last token and gives that token to the first
decode step, whose logits give the first new token. That step is a whole
pass over the weights for one token: ~37 ms of the 1.2B bench model's ~290
ms next turn, ~11 of the default model's ~46 (docs/benchmarks/agent-turns.md).
llama.cpp runs the last token inside its chunk and computes the logits of
that one row; so does flashserve, where it changes no number:

* Inside `prompt_matmul.prompt_rows` every row, even a chunk's only one, is
  computed as a prompt row: the integer GEMM (compute/prompt_matmul.py) and
  the prompt attention op (compute/prompt_attention.py), whose numbers for a
  row depend on that row and the keys it sees alone. A prompt's tail is run
  so, its last token with it, whatever its length: prefilled cold, the last
  token is one row of a longer tail; after a cached prompt[:-1], a tail of
  its own; the same numbers either way. (Those numbers are a prompt row's,
  not a decode step's: the first new token comes from the integer GEMM's
  logits, as every other prompt position's logprobs do.)
* `folds(model)` says where that holds: on the CPU with flashserve's ops,
  float32 activations, every linear of the decoder layers on the integer
  GEMM (no MLX matmul, whose numbers for a row change with the rows beside
  it), and every cache trimmable (the state after prompt[:-1], which the
  prompt cache keeps, is then the state after the prompt cut back by one).
  Elsewhere prompts run as mlx-lm runs them.
* Only each sequence's last row goes on past the last decoder layer's
  attention (`last_rows`, `past_attention_rows`: its output projection and
  MLP) to the final norm and the LM head: a 151k-token head over a 36-token
  tail would cost more than the step saved.

Three prefills take it: the batch's (`FoldingPrompts`: mlx-lm's
PromptProcessingBatch whose move to generation runs the tail; the worker
inserts the tail as one `Tail` entry, `segments`), one outside the batch
(alone.py) and the layer-major prefill (layer_major.py). A model split
across ranks does not fold (its followers replay plain batch operations), so
on a model that folds in one process its first token's numbers are a decode
step's there, a few float32 roundings apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from flashserve.engine.compute import prompt_matmul, step_ops
from flashserve.engine.generation.decode_step import CompiledDecode
from flashserve.engine.speculative import mlx_lm_internals as internals
from flashserve.engine.weights.layout import layer_list
from flashserve.engine.weights.model import compute_dtype


def folds(model: Any) -> bool:
    """Whether `model`'s prompts run their last token in their last chunk (see above)."""
    model = _unwrapped(model)
    if mx.default_device() != mx.cpu or not step_ops.active() or compute_dtype() != mx.float32:
        return False
    parts = model.__dict__.get("_flashserve_fold_parts")
    if parts is None:
        parts = _FoldParts(model)
        model.__dict__["_flashserve_fold_parts"] = parts  # beside the parameters, not in them
    return parts.possible and all(prompt_matmul.integer_weights(m) for m in parts.linears)


def _unwrapped(model: Any) -> Any:
    """The model itself, where BatchGenerator holds its compiled-decode wrapper."""
    return model.model if isinstance(model, CompiledDecode) else model


def engine_folds(loaded: Any, mirror: Any) -> bool:
    """Whether an engine's prompts fold: not on a model split across ranks (their
    followers replay plain batch operations), nor on an MoE (`folds` rules out resident
    experts; offloaded ones take their own prompt paths)."""
    if mirror is not None or loaded is None or loaded.experts is not None:
        return False
    return folds(loaded.model)


class _FoldParts:
    """What `folds` asks of a model that does not change: its layers' quantized linears
    (their prompt_matmul setting may), and whether anything else rules folding out."""

    def __init__(self, model: nn.Module) -> None:
        layers = layer_list(model)
        modules = [m for layer in layers or () for _, m in layer.named_modules()]
        self.linears = [m for m in modules if isinstance(m, nn.QuantizedLinear)]
        other = [m for m in modules if isinstance(m, nn.Linear) or "Switch" in type(m).__name__]
        self.possible = (
            bool(layers) and not other and can_trim_prompt_cache(make_prompt_cache(model))
        )


class Tail:
    """A prompt's last chunk, its last token included, as one entry of a segment.

    mlx-lm's BatchGenerator moves a sequence to generation once its prompt is
    down to one segment of one entry (its last token); a `Tail` there makes
    that move run the whole tail (`FoldingPrompts.generate`).
    """

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def __repr__(self) -> str:
        return f"Tail({len(self.tokens)} tokens)"


def segments(tokens: list[int], step: int) -> list[list[Any]]:
    """The prompt (the tokens left to prefill) as BatchGenerator segments: chunks of
    `step` tokens as mlx-lm cuts them, then the last 1 to `step` tokens as a Tail."""
    head = (len(tokens) - 1) // step * step
    return ([tokens[:head]] if head else []) + [[Tail(tokens[head:])]]


def _take_rows(x: mx.array, rows: list[int]) -> mx.array:
    """(batch, 1, ...) : row rows[b] of each sequence b of a (batch, length, ...) array."""
    if rows == [x.shape[1] - 1] * x.shape[0]:
        return x[:, -1:]
    return mx.take_along_axis(x, mx.array(rows).reshape(-1, *([1] * (x.ndim - 1))), axis=1)


class _RowsOf:
    """Stands in for a module of the last layer past its attention (the output
    projection, the MLP): its input cut to each sequence's last row first."""

    def __init__(self, module: Any, rows: list[int], width: int) -> None:
        self.module = module
        self.rows = rows
        self.width = width  # the tail's rows: only inputs of that many rows are cut

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(x, mx.array) and x.ndim == 3 and x.shape[1] == self.width > 1:
            x = _take_rows(x, self.rows)
        return self.module(x, *args, **kwargs)


@contextmanager
def past_attention_rows(layer: Any, rows: list[int], width: int) -> Iterator[None]:
    """Within the block, the layer's output projection and MLP take each sequence's
    last row only, where the layer has them as mlx-lm's decoder layers name them
    (`self_attn.o_proj`, `mlp`).

    Past the attention nothing mixes rows: the projection, the norms, the MLP and
    the residual adds are each row's own. Their other rows feed only the rows the
    caller drops, so the residual adds may broadcast the one row over them; and a
    row's numbers are the same computed alone (the integer GEMM, `folds`). The
    keys and values of every row still go into the cache. Saves the last layer's
    projection and MLP for all rows but one: ~3% of a 36-row next turn's forward
    on the 1.2B bench model (24 layers)."""
    swapped = []
    for owner, name in ((getattr(layer, "self_attn", None), "o_proj"), (layer, "mlp")):
        if isinstance(owner, nn.Module) and isinstance(owner.get(name), nn.Module):
            swapped.append((owner, name, owner[name]))
            owner[name] = _RowsOf(owner[name], rows, width)
    try:
        yield
    finally:
        for owner, name, module in swapped:
            owner[name] = module


class _LastRows:
    """Stands in for the last decoder layer: its output, only each sequence's last row."""

    def __init__(self, layer: Any, rows: list[int]) -> None:
        self.layer = layer
        self.rows = rows  # the row of each sequence's last token
        self.sliced = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)  # what the forward reads from its layers

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> Any:
        width = h.shape[1] if isinstance(h, mx.array) and h.ndim == 3 else 0
        with past_attention_rows(self.layer, self.rows, width):
            out = self.layer(h, *args, **kwargs)
        if not isinstance(out, mx.array) or out.ndim != 3:
            return out  # a layer of another shape: the caller takes the rows from the logits
        self.sliced = True
        return _take_rows(out, self.rows)


@contextmanager
def last_rows(model: Any, rows: list[int]) -> Iterator[_LastRows]:
    """Within the block, the model's forward goes past its last decoder layer with the
    rows `rows` (one per sequence) only; `.sliced` says whether it could."""
    model = _unwrapped(model)
    layers = layer_list(model)
    assert layers, "folds() checked the layer list"
    gate = _LastRows(layers[-1], rows)
    layers[-1] = gate
    try:
        yield gate
    finally:
        layers[-1] = gate.layer


def tail_logits(model: Any, cache: list[Any], tails: list[list[int]]) -> mx.array:
    """Run each sequence's tail into its row of the batch's `cache`: the (batch, vocab)
    logits after each tail's last token. Tails of different lengths are padded on the
    right, as mlx-lm's prompt processing pads them."""
    lengths = [len(t) for t in tails]
    width = max(lengths)
    padding = [width - n for n in lengths]
    if any(padding):
        for c in cache:
            c.prepare(lengths=lengths, right_padding=padding)
    tokens = mx.array([t + [0] * (width - len(t)) for t in tails])
    rows = [n - 1 for n in lengths]
    with prompt_matmul.prompt_rows(), last_rows(model, rows) as gate:
        logits = model(tokens, cache=cache)
    if not gate.sliced:
        logits = mx.take_along_axis(logits, mx.array(rows)[:, None, None], axis=1)
    if any(padding):
        for c in cache:
            c.finalize()
    return logits.reshape(len(tails), -1)


class _Replay:
    """The model for a GenerationBatch's first step: the tails' logits, already made."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        return self.logits[:, None, :]


class FoldingPrompts(PromptProcessingBatch):
    """mlx-lm's prompt batch whose move to generation runs each sequence's `Tail`.

    mlx-lm's `generate` runs what is left of each prompt but its last token,
    then makes a GenerationBatch whose first step runs the last tokens. Here
    the tails run in one pass with the last tokens' logits, and that first
    step takes those logits instead of running the model (`_Replay`): sampling,
    logits processors and the tokens kept are mlx-lm's own. Sequences that
    move without a Tail (a first token sampled outside the batch) go mlx-lm's way.
    """

    def prompt(self, tokens: list[list[int]]) -> None:
        # A prompt's full chunks before its tail, as prompt rows too where the model
        # folds (a chunk of up to 8 tokens would otherwise take the decode attention).
        with prompt_matmul.prompt_rows() if folds(self.model) else nullcontext():
            super().prompt(tokens)

    def generate(self, tokens: list[list[Any]]) -> GenerationBatch:
        tails = [t[0] if len(t) == 1 and isinstance(t[0], Tail) else None for t in tokens]
        if not any(tails):
            return super().generate(tokens)
        if not all(tails):
            plain = [i for i, t in enumerate(tails) if t is None]
            folded = [i for i in range(len(tokens)) if tails[i] is not None]
            generation = self.split(folded).generate([tokens[i] for i in folded])
            generation.extend(self.generate([tokens[i] for i in plain]))
            return generation
        rows = [t.tokens for t in tails if t is not None]
        for kept, tail in zip(self.tokens, rows, strict=True):
            kept += tail[:-1]  # the last joins in the first step, as in mlx-lm's
        logits = tail_logits(self.model, self.prompt_cache, rows)
        generation = GenerationBatch(
            _Replay(logits),  # type: ignore[arg-type]
            self.uids,
            mx.array([tail[-1] for tail in rows]),
            self.prompt_cache,
            self.tokens,
            self.samplers,
            self.fallback_sampler,
            self.logits_processors,
            self.stop_sequences,
            self.max_tokens,
        )
        generation.model = self.model
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return generation


def install(batch: Any) -> None:
    """Make an empty BatchGenerator's prompt batch a FoldingPrompts."""
    current = internals.prompt_batch(batch)
    assert not current.uids, "install before anything is inserted"
    internals.set_prompt_batch(
        batch,
        FoldingPrompts.empty(
            current.model, current.fallback_sampler, prefill_step_size=current.prefill_step_size
        ),
    )
