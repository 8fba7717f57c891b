"""The checksum of every read (engine/weights/checksum.py): zlib's values, faster."""

from __future__ import annotations

import os
import zlib

from flashserve.engine.weights.checksum import crc32


def test_crc32_gives_zlibs_values_whole_and_running() -> None:
    data = os.urandom(3 << 20) + b"tail"
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[5:]) == zlib.crc32(data[5:])
    running = 0
    for start in range(0, len(data), 1 << 20):
        running = crc32(data[start : start + (1 << 20)], running)
    assert running == zlib.crc32(data)
    assert crc32(b"") == 0


def test_the_fast_crc32_is_the_one_in_use() -> None:
    assert crc32.__module__.startswith("isal"), crc32.__module__
