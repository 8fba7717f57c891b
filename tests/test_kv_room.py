"""A restored state merges into the batch with room for its prompt's next tokens
(engine/kv/room.py): the first chunk is written in place, never by a copy of
the whole cache, and what every sequence attends to is what mlx-lm's merge
gives. Greedy identity on real models: the prompt-cache tests (every hit goes
through this merge)."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from flashserve.engine.kv import room
from flashserve.engine.kv.room import with_room


def _filled(tokens: int, seed: int) -> KVCache:
    cache = KVCache()
    mx.random.seed(seed)
    cache.update_and_fetch(mx.random.normal((1, 2, tokens, 8)), mx.random.normal((1, 2, tokens, 4)))
    return cache


@pytest.mark.parametrize("copy_op", ["flashserve", "mlx"])
@pytest.mark.parametrize("lengths", [(5,), (5, 3), (300, 7)])
def test_merge_with_room_writes_the_next_chunk_in_place_and_attends_alike(
    lengths, copy_op, monkeypatch: pytest.MonkeyPatch
):
    # The CPU's copy (csrc/step_cache.cpp: rows_with_room), or MLX's zeros and
    # slice updates, which a GPU (or a build without the extension) takes.
    assert copy_op == "mlx" or room.qmm.extension() is not None
    if copy_op == "mlx":
        monkeypatch.setattr(room.qmm, "extension", lambda: None)
    caches = [_filled(n, seed) for seed, n in enumerate(lengths)]
    plain = KVCache.merge(copy.deepcopy(caches))  # no room: mlx-lm's merge
    roomy = KVCache.merge(with_room(copy.deepcopy(caches), 40))
    assert isinstance(roomy, BatchKVCache)
    assert plain.keys.shape[2] == max(lengths)  # mlx-lm: exactly the longest state
    size = roomy.keys.shape[2]
    assert size >= max(lengths) + 40
    mx.random.seed(9)
    new_k = mx.random.normal((len(lengths), 2, 40, 8))
    new_v = mx.random.normal((len(lengths), 2, 40, 4))
    want = plain.update_and_fetch(new_k, new_v)
    got = roomy.update_and_fetch(new_k, new_v)
    assert roomy.keys.shape[2] == size  # written in place: no growth
    assert plain.keys.shape[2] > max(lengths)  # mlx-lm's grew (a copy of the cache)
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    assert mx.array_equal(plain.offset, roomy.offset).item()
    assert mx.array_equal(plain.left_padding, roomy.left_padding).item()
    assert plain.size() == roomy.size()


def test_without_room_the_buffer_is_exactly_the_longest_state():
    """No room asked (a fresh prompt, or room 0): mlx-lm's merge, no memory past the state."""
    caches = [_filled(6, 1), _filled(2, 2)]
    ours = KVCache.merge(with_room(copy.deepcopy(caches), 0))
    theirs = BatchKVCache.merge(copy.deepcopy(caches))
    assert ours.keys.shape == theirs.keys.shape == (2, 2, 6, 8)
    assert mx.array_equal(ours.keys, theirs.keys).item()
    assert ours.size() == theirs.size() == 6
