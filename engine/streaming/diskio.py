"""Disk helpers shared by streaming, the expert store and the benchmark."""

from __future__ import annotations

import os
import time
from pathlib import Path


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
