"""The prompt cache's disk tier writes only what is new (issue 42, item 5).

A growing conversation's next state is written as a segment: the positions
past the longest prefix already on disk, continuing that prefix's file. These
tests count the bytes written, check that a chain reads back as exactly the
KV that was written, that a chain missing a file is never served, and the
write budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.models.cache import make_prompt_cache

from flashserve.engine.prompt_cache import disk as prompt_disk
from flashserve.engine.prompt_cache import files as prompt_files
from flashserve.engine.prompt_cache.disk import DiskTier

from .test_prompt_cache import BASE, GROWN, _in_turn
from .test_prompt_cache_disk import _disk_engine

# Token ids stay under the tiny models' vocabulary (320).
TURN_1 = list(range(10, 210))  # 200 tokens
TURN_2 = [*TURN_1, *range(220, 284)]  # the next turn: the same 200, then 64 more
BRANCH = [*TURN_1[:120], *range(290, 310)]  # diverges at position 120


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    return mlx_load(str(tiny_llama_dir))[0]


def _state(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _kv_bytes_per_token(cache: list) -> int:
    return sum(c.keys[:, :, :1].nbytes + c.values[:, :, :1].nbytes for c in cache)


def _put(tier: DiskTier, model, tokens: list[int]) -> int:
    """Write the state after `tokens`; return the bytes the tier wrote for it."""
    before = tier.stats.bytes_written
    tier.put(prompt_files.prepare(tokens, _state(model, tokens)))
    assert tier.flush()
    return tier.stats.bytes_written - before


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{prompt_files.SUFFIX}"))


def test_a_grown_conversation_writes_only_its_new_tokens(model, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "segments-model")
    first, grown = _state(model, TURN_1), _state(model, TURN_2)
    kv = _kv_bytes_per_token(first)
    assert _put(tier, model, TURN_1) <= 1.2 * len(TURN_1) * kv
    new = len(TURN_2) - len(TURN_1)
    written = _put(tier, model, TURN_2)
    assert written <= 1.2 * new * kv, (written, new * kv)
    assert len(_files(tmp_path)) == 2  # the first turn's file is reused, not rewritten

    # The chain reads back as exactly the KV written: the first turn's 200
    # positions, then the second turn's 64 new ones.
    name, entry_tokens, usable = tier.lookup([*TURN_2, 1])
    assert (entry_tokens, usable) == (len(TURN_2), len(TURN_2))
    tokens, cache = tier.load(name)
    assert tokens == TURN_2
    for got, a, b in zip(cache, first, grown, strict=True):
        assert got.offset == len(TURN_2)
        for field in ("keys", "values"):
            want = mx.concatenate(
                [
                    getattr(a, field)[:, :, : len(TURN_1)],
                    getattr(b, field)[:, :, len(TURN_1) : len(TURN_2)],
                ],
                axis=2,
            )
            assert mx.array_equal(getattr(got, field)[:, :, : got.offset], want).item()
    assert tier.stats.bytes_read == sum(p.stat().st_size for p in _files(tmp_path))
    tier.close()


def test_a_branch_continues_from_where_it_diverges(model, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "segments-model")
    kv = _kv_bytes_per_token(_state(model, TURN_1[:1]))
    _put(tier, model, TURN_1)
    written = _put(tier, model, BRANCH)  # continues TURN_1's file part way through it
    assert written <= 1.2 * (len(BRANCH) - 120) * kv
    name, _, _ = tier.lookup([*BRANCH, 1])
    tokens, cache = tier.load(name)
    assert tokens == BRANCH and all(c.offset == len(BRANCH) for c in cache)
    # A prefix of what is on disk writes nothing.
    assert _put(tier, model, TURN_1[:150]) == 0
    tier.close()

    # After a restart the chains are found again, branch included.
    again = DiskTier(tmp_path, 1 << 30, "segments-model")
    assert again.lookup([*BRANCH, 1])[2] == len(BRANCH)
    assert again.lookup([*TURN_1, 1])[2] == len(TURN_1)
    again.close()


def test_a_chain_missing_a_file_is_never_served(model, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "segments-model")
    _put(tier, model, TURN_1)
    _put(tier, model, TURN_2)
    root = tier.lookup([*TURN_1[:50], 1])[0]
    name = tier.lookup([*TURN_2, 1])[0]
    (tmp_path / root).unlink()  # gone under it (another server's eviction, a user)
    assert tier.load(name) is None
    assert _files(tmp_path) == []  # the file continuing it went too
    assert tier.lookup([*TURN_2, 1]) is None
    tier.close()

    # Across a restart: a file whose parent is gone is deleted, not indexed.
    tier = DiskTier(tmp_path, 1 << 30, "segments-model")
    _put(tier, model, TURN_1)
    _put(tier, model, TURN_2)
    tier.close()
    root = next(
        p
        for p in _files(tmp_path)
        if len(prompt_files.read_header(p, "segments-model").tokens) == len(TURN_1)
    )
    root.unlink()
    again = DiskTier(tmp_path, 1 << 30, "segments-model")
    assert again.lookup([*TURN_2, 1]) is None and _files(tmp_path) == []
    again.close()


def test_a_corrupt_parent_discards_its_chain(model, tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "segments-model")
    _put(tier, model, TURN_1)
    _put(tier, model, TURN_2)
    root = tmp_path / tier.lookup([*TURN_1[:50], 1])[0]
    data = bytearray(root.read_bytes())
    data[-100] ^= 0xFF
    root.write_bytes(bytes(data))
    assert tier.load(tier.lookup([*TURN_2, 1])[0]) is None
    assert tier.stats.discarded == 1 and _files(tmp_path) == []
    tier.close()


def test_eviction_takes_a_chain_from_its_leaves_never_leaving_it_short(
    model, tmp_path: Path
) -> None:
    probe = DiskTier(tmp_path / "probe", 1 << 30, "segments-model")
    one = _put(probe, model, TURN_1)
    probe.close()
    tier = DiskTier(tmp_path / "cache", int(one * 2.2), "segments-model")
    _put(tier, model, TURN_1)
    _put(tier, model, TURN_2)
    other = [7, *TURN_1[1:]]  # a second conversation: room is made for it
    _put(tier, model, other)
    snapshot = tier.snapshot()
    assert snapshot["dir_bytes"] <= int(one * 2.2) and snapshot["evicted"] >= 1
    for prompt in (TURN_1, TURN_2, other):
        found = tier.lookup([*prompt, 1])
        if found is not None:  # whatever is still indexed reads back whole
            assert tier.load(found[0]) is not None
    assert tier.lookup([*other, 1])[2] == len(other)
    tier.close()


def test_the_write_budget_drops_states_past_it(model, tmp_path: Path) -> None:
    probe = DiskTier(tmp_path / "probe", 1 << 30, "segments-model")
    one = _put(probe, model, TURN_1)
    probe.close()
    budget = one * 3 // 2  # room for one such state an hour, not two
    tier = DiskTier(tmp_path / "cache", 1 << 30, "segments-model", write_bytes_per_hour=budget)
    assert _put(tier, model, TURN_1) == one
    assert _put(tier, model, [9, *TURN_1[1:]]) == 0  # would pass the hour's budget
    snapshot = tier.snapshot()
    assert snapshot["dropped_over_budget"] == 1 and snapshot["dropped"] == 1
    assert snapshot["write_bytes_per_hour"] == budget
    assert snapshot["bytes_written_last_hour"] == one == snapshot["bytes_written"]
    tier.close()


def test_the_default_directory_is_one_per_model() -> None:
    first = prompt_disk.default_dir("a" * 64)
    second = prompt_disk.default_dir("b" * 64)
    assert first.parent == second.parent and first.name == "a" * 16 and first != second


def test_an_engine_turn_writes_only_what_the_turn_added(
    cache_arch_dirs: dict[str, Path], tmp_path: Path
) -> None:
    model = cache_arch_dirs["llama"]
    config = json.loads((model / "config.json").read_text())
    # float32 on the CPU: keys and values, every layer
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    engine = _disk_engine(model, tmp_path)
    try:
        _in_turn(engine, [BASE])
        disk = engine.prompt_cache.disk
        assert disk.flush()
        before = disk.stats.bytes_written
        ((second, cached),) = _in_turn(engine, [GROWN])  # resends BASE, then 20 more
        assert disk.flush()
        written = disk.stats.bytes_written - before
    finally:
        engine.shutdown()
    assert cached == len(BASE)
    # Not on disk before this turn: the prompt past BASE, and the answer.
    new = len(GROWN) + len(second) - cached
    assert written <= 1.2 * new * kv, (written, new * kv)
    assert written < (len(GROWN) + len(second)) * kv / 2  # far from the whole state
