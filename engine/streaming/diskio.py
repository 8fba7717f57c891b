"""Disk helpers shared by streaming, the expert store and the benchmark."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flashserve.engine.compute import heap
from flashserve.engine.weights.reader import DIRECT_ALIGN, open_direct


def drop_page_cache(path: str | Path) -> int:
    """Ask the kernel to drop `path` (a file or every file under a dir) from the page cache.

    Returns the number of files advised. A no-op where posix_fadvise is missing
    (macOS); there, cold numbers need `sudo purge`.
    """
    if not hasattr(os, "posix_fadvise"):
        return 0
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a file just written) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def measure_read_speed(path: str | Path, block: int = 16 << 20, limit: int = 1 << 30) -> float:
    """Cold sequential read speed of the files under `path`, in bytes per second."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    drop_page_cache(path)
    buffer = bytearray(block)
    total = 0
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while total < limit and (n := f.readinto(buffer)):
                total += n
        if total >= limit:
            break
    elapsed = time.perf_counter() - start
    return total / max(elapsed, 1e-9)


def random_read_speed(
    files: list[Path], record: int, threads: int, *, direct: bool, total: int = 1 << 30
) -> float:
    """Cold speed, bytes/s, of `record`-sized reads at random block-aligned places in
    `files` by `threads` readers: through the page cache, or around it (`direct`,
    as the expert store reads where the system allows)."""
    rng = random.Random(threads)
    sizes = [f.stat().st_size for f in files]
    places = []
    for _ in range(max(1, total // record)):
        i = rng.randrange(len(files))
        place = rng.randrange(max(1, sizes[i] - record))
        places.append((i, place - place % DIRECT_ALIGN))
    opened = [open_direct(f, direct) for f in files]
    span = -(-record // DIRECT_ALIGN) * DIRECT_ALIGN
    buffers = [_read_buffer(span) for _ in range(threads)]
    free = list(buffers)

    def read(place: tuple[int, int]) -> int:
        buffer = free.pop()
        try:
            return os.preadv(opened[place[0]][0], [buffer], place[1])
        finally:
            free.append(buffer)

    try:
        drop_page_cache(files[0].parent)
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(read, places))
        return done / max(time.perf_counter() - start, 1e-9)
    finally:
        for fd, _ in opened:
            os.close(fd)


def _read_buffer(size: int) -> memoryview:
    """`size` bytes at a 2 MB boundary, asked for 2 MB pages as the layer buffers are
    (weights/reader.py allocate, compute/heap.py huge_pages): the disk's speed for
    flashserve's own reads. A private map of its own (a shared one is shmem, which
    transparent huge pages leave alone here): never touched before the reads."""
    area = mmap.mmap(-1, size + heap.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    start = -address % heap.HUGE_PAGE
    heap.huge_pages(address + start, size)
    return memoryview(area)[start : start + size]


def best_random_read_speed(
    files: list[Path],
    record: int,
    threads: tuple[int, ...] = (4, 8),
    direct: tuple[bool, ...] = (False, True),
    total: int = 1 << 30,
) -> float:
    """The best random_read_speed over these reader counts, through the page cache and
    around it; 0.0 without files."""
    return max(
        (
            random_read_speed(files, record, n, direct=d, total=total)
            for n in threads
            for d in direct
        ),
        default=0.0,
    )
