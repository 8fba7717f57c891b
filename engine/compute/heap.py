"""glibc's malloc, tuned for a process that must stay inside a memory limit.

glibc serves blocks from its arenas up to a threshold that grows to the largest
block freed (up to 32 MB): a prefill's activations then stay in the arenas as
free memory the process keeps. The memory plan (streaming/memplan.py) fixes the
threshold at MMAP_THRESHOLD, so large blocks get maps of their own, given back
when freed (measured: 95 MB less private memory after one prefill).

A prefill pays for that: each of its large activations is mapped afresh and
faulted in 4 KB at a time (3.3 million faults, ~7 s of system time in the cap
bench's 632-token prefill). So while one runs, the threshold is raised to
PREFILL_MMAP_THRESHOLD and the arenas reuse the blocks; when it ends the
threshold goes back, and `trim` (malloc_trim) returns the arenas' free pages
once its arrays are dropped (measured:
2.0 million faults, 14.4 s to the first token instead of 16.7 s, private memory
after the turn the same). Elsewhere than glibc these are no-ops.
"""

from __future__ import annotations

import ctypes
import functools
import sys

MMAP_THRESHOLD = 256 * 1024
PREFILL_MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit systems
# Arenas glibc may make: each thread that allocates gets one (up to 8 per core),
# and an arena keeps what was freed in it. The I/O, kernel and MLX threads each
# filled one: after one 681-token prompt of a 1.2B dense model, 10 arenas of
# ~60 MB each (private memory 774 MB; 378 MB with two arenas and the threshold
# fixed).
ARENA_MAX = 2
_M_MMAP_THRESHOLD = -3  # mallopt's parameter numbers (malloc.h)
_M_ARENA_MAX = -8

_fixed: int | None = None  # the threshold the plan set; None: glibc's own
_raised = False  # a prefill runs with PREFILL_MMAP_THRESHOLD
_used = False  # a prefill has run with it


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def limit_arenas(count: int = ARENA_MAX) -> bool:
    """Cap glibc's arenas (threads share them beyond `count`); False where there is no
    glibc. Call before the threads that allocate start: an arena made stays."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, count))
    except AttributeError:
        return False


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold; False where there is no glibc."""
    global _fixed
    libc = _libc()
    try:
        done = libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes))
    except AttributeError:
        return False
    if done:
        _fixed = nbytes
    return done


def enter_prefill() -> None:
    """Large blocks from the arenas while a prefill runs (where the plan fixed the
    threshold: glibc's own one grows by itself)."""
    global _raised, _used
    libc = _libc()
    if _fixed is not None and libc is not None:
        _raised = bool(libc.mallopt(_M_MMAP_THRESHOLD, PREFILL_MMAP_THRESHOLD))
        _used = _used or _raised


def leave_prefill() -> None:
    """The plan's threshold again."""
    global _raised
    libc = _libc()
    if _raised and _fixed is not None and libc is not None:
        _raised = False
        libc.mallopt(_M_MMAP_THRESHOLD, _fixed)


def trim(always: bool = False) -> None:
    """Give the arenas' free pages back to the system (after a prefill ran with the
    raised threshold). What a prefill allocates and leaves behind lives in the
    arenas too: its KV, the state stored from it. Freed later, when the answer
    ends or the prompt cache has written that state, it stays there until this
    runs (measured: 85-95 MB after the cap bench's first turn), so those are
    the places that call it. `always`: also when no plan raised the threshold
    (a model unloaded: engine/models/pool.py)."""
    libc = _libc()
    if (_used or always) and libc is not None:
        libc.malloc_trim(0)


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # madvise's advice number (Linux)


def huge_pages(address: int, size: int) -> bool:
    """Ask Linux for 2 MB pages under the 2 MB-aligned part of [address, address +
    size), memory not yet touched; False where there is no such advice.

    A read around the page cache (O_DIRECT) goes to the device in requests of at
    most as many pages as it takes segments (virtio: 254, ~1 MB in 4 KB pages), so
    4 KB pages split each 4 MB chunk into several requests. Layer files read into
    4 KB pages at 1.1-1.2 GB/s and into 2 MB pages at 1.8 GB/s, the same disk the
    same minutes (8 threads of 4 MB reads; 4 threads of 8 or 16 MB alike).
    Transparent huge pages set to `madvise` (a common default) give them only
    where asked.
    """
    libc = _libc()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + size) // HUGE_PAGE * HUGE_PAGE
    if libc is None or end <= start:
        return False
    length = ctypes.c_size_t(end - start)
    try:
        return libc.madvise(ctypes.c_void_p(start), length, _MADV_HUGEPAGE) == 0
    except AttributeError:
        return False
