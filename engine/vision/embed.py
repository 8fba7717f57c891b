"""A prompt chunk's input embeddings with the images' features merged in, and the
vision tower's thread that encodes them while the batch decodes.

The worker prefills a prompt that holds images outside the batch, chunk by
chunk (generation/prefill/alone.py), passing each chunk's embeddings to the
mlx-lm model as `input_embeddings`: the token embeddings of the language
model that runs (resident or streamed), with each image's placeholder rows
replaced by its features. Each image is encoded once, on the vision thread
before its prompt's prefill (ImageEncodes): one the prompt cache already
covers never is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.kv.room import with_room
from flashserve.engine.vision import mrope
from flashserve.engine.vision.images import Image
from flashserve.engine.vision.prompt import VIRTUAL_BASE, real_tokens, virtual_id
from flashserve.engine.vision.tower import VisionModel

log = logging.getLogger(__name__)

Embed = Callable[[int, Sequence[int]], mx.array]


def image_embedder(
    loaded: Any,
    prompt: Sequence[int],
    images: Sequence[Image],
    encoded: Future | None = None,
    cache: list[Any] | None = None,
) -> Embed | None:
    """embed(start, chunk): prompt[start:start+len(chunk)]'s (1, L, hidden) embeddings;
    None for a prompt without images. `encoded`: the images ImageEncodes encoded ahead
    (their features by digest); any other image is encoded here when a chunk needs it.
    An M-RoPE model's `cache` (the prompt's, to prefill) is given the prompt's positions
    (vision/mrope.py): prefill it with these embeddings, nothing else."""
    vision: VisionModel | None = loaded.vision
    if not images or vision is None:
        return None
    positions = None  # an M-RoPE prompt's: its chunks' deepstack rows wait on them too
    if cache is not None:
        positions = vision.positions(list(prompt), list(images))
        if positions is not None:
            mrope.place(cache, positions)
    embed_tokens = _token_embedding(loaded.model)
    token_id = vision.tokens.token_id
    by_id = {virtual_id(image, token_id): image for image in images}
    # Each position's (image, row): a run starts at a virtual id; placeholders follow.
    slots: dict[int, tuple[Image, int]] = {}
    current: Image | None = None
    row = 0
    for position, token in enumerate(prompt):
        if token >= VIRTUAL_BASE:
            current, row = by_id[token], 0
        elif token == token_id and current is not None:
            row += 1
        else:
            current = None
            continue
        slots[position] = (current, row)
    # An image's features, for every chunk it spans (the encode's error raised here).
    features: dict[str, mx.array] = dict(encoded.result()) if encoded is not None else {}

    def embed(start: int, chunk: Sequence[int]) -> mx.array:
        h = embed_tokens(mx.array([real_tokens(chunk)]))
        here = [(p - start, slots[p]) for p in range(start, start + len(chunk)) if p in slots]
        if not here:
            return h
        for _, (img, _) in here:
            if img.digest not in features:
                features[img.digest] = vision.features(img)
        order = list(dict.fromkeys(img.digest for _, (img, _) in here))
        table = mx.concatenate([features[d] for d in order]).astype(h.dtype)
        offsets = dict(zip(order, [0, *[int(x) for x in _cumsum(features, order)]], strict=False))
        index = [0] * len(chunk)
        mask = [False] * len(chunk)
        for at, (img, r) in here:
            index[at], mask[at] = offsets[img.digest] + r, True
        if table.shape[-1] > h.shape[-1]:  # Qwen3-VL: its deepstack parts follow
            table, *deep = mx.split(table, table.shape[-1] // h.shape[-1], axis=-1)
            if positions is not None:  # added after the first layers (vision/mrope.py)
                positions.deepstack[start] = _deepstack_rows(deep, index, mask)
        rows = table[mx.array(index)][None]
        return mx.where(mx.array(mask)[None, :, None], rows, h)

    return embed


class ImageEncodes:
    """Images encoded on a thread of their own (flashserve-vision) while the batch decodes.

    The worker hands every request it admits to `ready`: one whose images past
    its cached prefix need the tower waits here, its images encoding, and comes
    back from a later call once they are done; the worker then prefills it with
    those features (image_embedder's `encoded`). With nothing decoding there is
    nothing to overlap: `ready(..., wait=True)` waits for them.
    """

    def __init__(self, loaded: Callable[[], Any], refuse: Callable[[Any, BaseException], None]):
        self._loaded = loaded  # the worker's LoadedModel, once loaded
        self._refuse = refuse  # the worker's: a request's error event (its images failed)
        self._jobs: queue.SimpleQueue | None = None  # the vision thread's, once started
        self._parked: list[Any] = []  # the worker's Starts, in arrival order

    @property
    def waiting(self) -> bool:
        return bool(self._parked)

    def ready(self, starts: list[Any], wait: bool) -> list[Any]:
        """Of the parked and the new `starts`, those to prefill now, in arrival order."""
        new = []
        for start in starts:
            try:
                needed = self._needed(start)
            except Exception as exc:  # fails its request alone
                self._refuse(start.handle, exc)
                continue
            if needed:
                start.encoded = self._submit(needed)
                self._parked.append(start)
            else:
                new.append(start)
        if wait:
            futures_wait([s.encoded for s in self._parked])
        done = [s for s in self._parked if s.encoded.done()]
        self._parked = [s for s in self._parked if not s.encoded.done()]
        now = time.perf_counter()
        for start in done:  # the TTFT's image_encode part ends here
            start.handle.encoded_at = now
            if (exc := start.encoded.exception()) is not None:
                request_id = start.handle.request.request_id
                log.error("request %s: its images failed to encode: %s", request_id, exc)
                self._refuse(start.handle, exc)  # it alone: the others prefill on
        return [s for s in done if s.encoded.exception() is None] + new

    def _needed(self, start: Any) -> list[Image]:
        """The start's images that reach past its cached prefix (start.reused)."""
        images = start.handle.request.images
        vision = self._loaded().vision if images else None
        if vision is None:
            return []
        by_id = {virtual_id(image, vision.tokens.token_id): image for image in images}
        needed = {}
        for position, token in enumerate(start.prompt):
            if token >= VIRTUAL_BASE and position + vision.count(by_id[token]) > start.reused:
                needed[by_id[token].digest] = by_id[token]
        return list(needed.values())

    def _submit(self, images: list[Image]) -> Future:
        vision = self._loaded().vision
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            # A daemon thread, as the worker is: a pool's thread is joined as Python
            # exits, and its end then runs MLX's thread-local destructors (compiled
            # functions, which take the GIL) while the interpreter finalizes, which
            # aborts the process. It ends when these encodes are dropped (an unload).
            thread = threading.Thread(
                target=_encode_jobs, args=(self._jobs,), name="flashserve-vision_0", daemon=True
            )
            thread.start()
            # Not at exit: the thread's end would then come as Python finalizes.
            weakref.finalize(self, self._jobs.put, None).atexit = False
        future: Future = Future()
        self._jobs.put((future, lambda: {i.digest: vision.features(i) for i in images}))
        return future


def batch_caches(loaded: Any, cache: list[Any] | None, room: int = 0) -> list[list[Any]] | None:
    """What the worker inserts into the batch for a sequence whose state is `cache`
    (None: the batch makes one), merged with room for `room` more tokens
    (kv/room.py). An M-RoPE model's caches all merge with their sequence's rope
    delta: mlx-lm merges through the first, which may be any of them."""
    cache = with_room(cache, room)
    vision = loaded.vision if loaded is not None else None
    if vision is None or vision.qwen is None:
        return [cache] if cache is not None else None
    return [mrope.joining(cache if cache is not None else make_prompt_cache(loaded.model))]


def _encode_jobs(jobs: queue.SimpleQueue) -> None:
    """The vision thread: each job's result (or error) into its future, until None."""
    while (job := jobs.get()) is not None:
        _encode(*job)
        del job  # nothing of a finished job (its images, the tower) held while waiting


def _encode(future: Future, encode: Callable[[], Any]) -> None:
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(encode())
        except BaseException as exc:  # the request's error: ImageEncodes.ready reads it
            future.set_exception(exc)


def _deepstack_rows(
    deep: list[mx.array], index: list[int], mask: list[bool]
) -> tuple[mx.array, list[mx.array]]:
    """A chunk's deepstack rows as vision/mrope.py adds them: each part's image rows
    and a zero row (what the chunk's other rows add), and each row's place in them."""
    picked = [i for i, m in zip(index, mask, strict=True) if m]
    places, n = [], 0
    for m in mask:
        places.append(n if m else len(picked))
        n += m
    zero = mx.zeros((1, deep[0].shape[-1]), deep[0].dtype)
    rows = [mx.concatenate([d[mx.array(picked)], zero]) for d in deep]
    return mx.array(places), rows


def _cumsum(features: dict[str, mx.array], order: list[str]) -> list[int]:
    total, out = 0, []
    for digest in order:
        total += features[digest].shape[0]
        out.append(total)
    return out


def _token_embedding(model: Any) -> Any:
    """The language model's token embedding (mlx-lm nests it per architecture)."""
    for owner in (getattr(model, "language_model", None), model):
        inner = getattr(owner, "model", None)
        if inner is not None and hasattr(inner, "embed_tokens"):
            return inner.embed_tokens
    raise TypeError(f"{type(model).__name__} has no token embedding to merge images into")
