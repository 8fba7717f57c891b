"""Expert records are read around the page cache (experts/store.py).

An expert goes into the cache's own buffer, so a page-cache copy would be the
same bytes held twice, charged to a memory cgroup and reclaimed at a cost (the
cap bench's decode spent 10.6 s of system time on it in 21 s, 1.3 s with
O_DIRECT). O_DIRECT needs block-aligned offsets, lengths and addresses: each
record is read as the aligned span around it and is a view inside its buffer.
These check the bytes, the page cache, the fallback and buffer reuse.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from flashserve.engine.experts.store import ExpertStore, layouts_from_manifest
from flashserve.engine.streaming.diskio import drop_page_cache
from flashserve.engine.weights import reader as reader_module
from flashserve.engine.weights.layout import read_manifest
from tests.streaming_fixtures import prepared_model

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """The store reads around the page cache where MLX computes on the CPU; on a GPU
    (where the GPU check runs these) it reads through it. These check the CPU's reads."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def _record_bytes(store: ExpertStore, layer: int, expert: int) -> bytes:
    result = store.submit(layer, expert).result()
    assert result.record.size == result.nbytes
    return np.array(result.record).tobytes()


def _file_bytes(store: ExpertStore, layer: int, expert: int) -> bytes:
    offset, length = store.layouts[layer].records[expert]
    with open(store.layouts[layer].file, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _cached_pages(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


@pytest.fixture
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = prepared_model(tmp_path_factory, "qwen3_moe")
    return layouts_from_manifest(out, read_manifest(out))


def test_records_are_read_around_the_page_cache_and_equal_the_file(layouts: dict) -> None:
    store = ExpertStore(layouts, threads=2)
    try:
        assert all(store._aligned.values())  # ext4 under the tests: direct reads work
        layer = min(layouts)
        file = layouts[layer].file
        drop_page_cache(file)
        assert _cached_pages(file) == 0
        for expert in range(layouts[layer].num_experts):
            assert _record_bytes(store, layer, expert) == _file_bytes(store, layer, expert)
        # Everything read above came around the page cache; _file_bytes' own
        # buffered reads are dropped again first.
        drop_page_cache(file)
        for expert in range(layouts[layer].num_experts):
            _record_bytes(store, layer, expert)
        assert _cached_pages(file) == 0
    finally:
        store.close()


def test_a_file_system_without_direct_reads_reads_through_the_page_cache(
    layouts: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader_module, "_direct_reads_work", lambda fd: False)
    store = ExpertStore(layouts, threads=2)
    try:
        assert not any(store._aligned.values())
        layer = max(layouts)
        for expert in (0, layouts[layer].num_experts - 1):
            assert _record_bytes(store, layer, expert) == _file_bytes(store, layer, expert)
    finally:
        store.close()


def test_a_recycled_buffer_reads_the_next_record_whole(layouts: dict) -> None:
    store = ExpertStore(layouts, threads=1)
    try:
        layer = min(layouts)
        first = store.submit(layer, 0).result()
        store.recycle(first.buffer)
        again = store.submit(layer, 1).result()
        mx.eval(again.record)
        assert again.buffer is first.buffer  # read into the same allocation
        assert np.array(again.record).tobytes() == _file_bytes(store, layer, 1)
    finally:
        store.close()


def test_a_fresh_buffer_starts_its_read_without_waiting_for_the_mlx_stream(
    layouts: dict,
) -> None:
    """A fresh record buffer comes unwritten from flashserve's extension: the read starts
    at once, though the MLX stream is busy (a prefill's experts computing); zero-filled
    on the stream, it waited for all of that first."""
    from flashserve.engine.compute import qmm

    qmm.select("auto")
    ext = qmm.extension()
    if ext is None or not hasattr(ext, "uninitialized_bytes"):
        pytest.skip("flashserve's extension does not run here")
    with pytest.raises(ValueError):
        ext.uninitialized_bytes(0)
    store = ExpertStore(layouts, threads=1)
    try:
        layer = min(layouts)
        busy = mx.random.uniform(shape=(16 << 20,), key=mx.random.key(0))
        mx.eval(busy)
        # ~1-2 s of work queued on the stream, in fewer ops than MLX keeps in flight
        # before an eval blocks (async_eval returns at once), whatever the BLAS.
        for _ in range(4):
            busy = mx.sin(mx.exp(busy))
        start = time.perf_counter()
        mx.async_eval(busy)
        future = store.submit(layer, 2)
        submitted = time.perf_counter() - start
        result = future.result()
        mx.eval(busy)
        total = time.perf_counter() - start
        assert total > 0.3  # the stream was busy for a while
        assert submitted < 0.25 * total, (submitted, total)
        assert np.array(result.record).tobytes() == _file_bytes(store, layer, 2)
    finally:
        store.close()
