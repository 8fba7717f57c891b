"""The order streamed layers are read in (weights/reader.py, streaming/streamer.py).

A layer's read waits for the one queued before it where that one keeps the read
pool busy alone (FileRead `after`): two layers read at once share the disk, and
the one wanted first could end with the next. Whether a file system takes direct
reads is tested once, not with a read at every open that queues behind the reads
in flight.
"""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import Future
from typing import ClassVar

import numpy as np
import pytest
from mlx_lm.utils import load as mlx_lm_load

from flashserve.engine.config import EngineConfig
from flashserve.engine.loader import load
from flashserve.engine.streaming import streamer as streamer_module
from flashserve.engine.weights import reader
from flashserve.engine.weights.reader import FileRead, ReadPool, chunk_pieces
from tests.streaming_fixtures import prepared_model, source_model
from tests.test_streaming import PROMPT, greedy

CHUNK = 1 << 20


def _gate() -> Future:
    gate: Future = Future()
    gate.set_running_or_notify_cancel()
    return gate


@pytest.mark.parametrize("ends", ["with a result", "with an error", "never"])
def test_a_read_after_another_reads_nothing_until_that_one_ends(tmp_path, ends) -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 * CHUNK + 123, dtype=np.uint8)
    path = tmp_path / "layer.bin"
    path.write_bytes(data.tobytes())
    pool = ReadPool(4, "test-read-order")
    try:
        raw = np.zeros(data.size, dtype=np.uint8)
        gate = _gate()
        read = FileRead(
            path, data.size, chunk_pieces(raw, None, CHUNK), pool, task_bytes=CHUNK, after=gate
        )
        time.sleep(0.3)  # the file is open by now; its pieces wait
        assert not read.future.done()
        assert not raw.any()
        if ends == "with a result":
            gate.set_result(None)
        elif ends == "with an error":  # the earlier read's own waiter says so
            gate.set_exception(OSError("the earlier read failed"))
        # "never": a stalled earlier read, given up; the waiter starts this one
        read.wait(10)
        assert np.array_equal(raw, data)
    finally:
        pool.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_direct_reads_are_tested_once_per_file_system(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(reader, "_DIRECT_WORKS", {})
    reads = []
    preadv = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda fd, views, at: reads.append(at) or preadv(fd, views, at)
    )
    for i in range(3):
        path = tmp_path / f"layer-{i}.bin"
        path.write_bytes(bytes(8192))
        fd, _ = reader.open_direct(path, True)
        os.close(fd)
    assert len(reads) == 1  # the first open's test read; the file system is known then


class _Recorded(FileRead):
    made: ClassVar[list[FileRead]] = []

    def __init__(self, *args, after: Future | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs, after=after)
        self.after = after
        _Recorded.made.append(self)


def test_each_streamed_layer_is_read_after_the_one_before_where_it_fills_the_pool(
    tmp_path_factory, monkeypatch
) -> None:
    """A pool of two threads: one task fills it with the streamer's own (the one
    before runs), so every streamed read waits for the last one; greedy tokens are
    mlx-lm's. The shared pool of eight: the tiny model's one-task layers may overlap."""
    src = source_model(tmp_path_factory, "llama")
    prepared = prepared_model(tmp_path_factory, "llama")
    ref_tokens, _, _ = greedy(mlx_lm_load(str(src))[0], PROMPT)
    monkeypatch.setattr(streamer_module, "FileRead", _Recorded)
    for threads, chained in ((2, True), (None, False)):
        loaded = load(EngineConfig(model=str(prepared), resident_layers=0, prefetch_depth=1))
        streamer = loaded.streamer
        if threads is not None:
            streamer.pool = ReadPool(threads, "test-read-order")
        _Recorded.made = []
        try:
            tokens, _, _ = greedy(loaded.model, PROMPT)
        finally:
            if threads is not None:
                streamer.pool.close()
        assert tokens == ref_tokens
        made = _Recorded.made
        assert len(made) > len(streamer.layers)  # every layer read, token after token
        if chained:
            assert all(b.after is a.future for a, b in itertools.pairwise(made))
        else:
            assert all(read.after is None for read in made)
