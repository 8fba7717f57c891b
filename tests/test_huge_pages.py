"""Buffers that direct reads fill sit on 2 MB pages (compute/heap.py huge_pages).

A read around the page cache goes to the device in requests of as many pages as
it takes segments (virtio: 254), so 4 KB pages cut each 4 MB chunk into ~1 MB
requests; the cap bench's layer reads ran 1.1-1.2 GB/s into 4 KB pages and 1.8
into 2 MB ones. Transparent huge pages in `madvise` mode (a common default) give
them only where asked, before the memory is touched.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from flashserve.engine.compute import heap
from flashserve.engine.streaming.diskio import _read_buffer
from flashserve.engine.weights.reader import DIRECT_SLACK, allocate, direct_base, open_direct

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Past glibc's largest mmap threshold (32 MB): a map of its own, never touched before,
# whatever earlier allocations moved the threshold to.
SIZE = 37 << 20

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages: Linux, not turned off",
)


def _mapping(address: int) -> dict[str, str]:
    """The smaps fields of the mapping of this process that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            if inside:
                break
            inside = int(m[1], 16) <= address < int(m[2], 16)
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`."""
    return int(_mapping(address).get("AnonHugePages", "0 kB").split()[0])


def _direct_read(path: Path, target: memoryview) -> int:
    fd, direct = open_direct(path, True)
    try:
        assert direct  # this file system takes O_DIRECT
        return os.preadv(fd, [target], 0)
    finally:
        os.close(fd)


def test_a_buffer_a_direct_read_fills_gets_2mb_pages(tmp_path: Path) -> None:
    data = os.urandom(SIZE)
    path = tmp_path / "layer.bin"
    path.write_bytes(data)
    buffer, raw = allocate(SIZE + DIRECT_SLACK, unwritten=True)
    base = direct_base(raw)
    assert _direct_read(path, memoryview(raw[base : base + SIZE])) == SIZE
    assert bytes(raw[base : base + SIZE]) == data
    # Asked for (VmFlags "hg": MADV_HUGEPAGE) whatever memory the allocator handed back;
    # the pages are 2 MB where it had not been touched before (a map of its own, as a
    # layer buffer under a plan; in a long test session it may be reused heap).
    middle = raw.ctypes.data + base + SIZE // 2
    assert "hg" in _mapping(middle)["VmFlags"].split()
    del buffer


def test_the_disk_speed_is_measured_into_the_same_pages(tmp_path: Path) -> None:
    """The cap bench's I/O bound divides by diskio's speed: its reads land in 2 MB
    pages as the layers' do."""
    data = os.urandom(SIZE)
    path = tmp_path / "layer.bin"
    path.write_bytes(data)
    target = _read_buffer(SIZE)
    assert _direct_read(path, target) == SIZE and bytes(target) == data
    address = heap.ctypes.addressof(heap.ctypes.c_char.from_buffer(target))
    assert address % heap.HUGE_PAGE == 0
    assert _huge_kb(address + SIZE // 2) >= 18 * 2048
