"""How the disk tier's writer stays out of the requests' way.

A state's write is mostly CPU: its blake2b checksum (~1 GB/s) and the copy
into the page cache. On two cores, the 1.2B bench model's 1,200-token state
(~230 MB) written beside the next prompt's prefill took ~300 ms from that
prompt's first token. So the writer thread runs at the lowest CPU priority
(Linux: niceness is per thread), and between pieces of a state it waits while
some engine of the process prefills a prompt (generation/fairness.py tells),
up to MAX_PAUSE_S a state: writes move into the cores' idle time (an agent's
tool call, a client reading). A writer that falls behind drops states (the
write queue is bounded), which the memory tier still holds. A thread that
waits for a write (disk only: a lookup waits for its own state to land, and
its worker holds the prefill that would pause the writer) lifts the pause.

Not under a memory plan (streaming/memplan.py, denseplan.py): there a queued
state holds its bytes until written, and a writer held back kept a 1.2B
model's state in memory through its next decode (the cap bench's 0.85x cap:
OOM-killed); it writes at once, as before.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

WRITER_NICE = 19
MAX_PAUSE_S = 10.0  # per state: a prefill that never ends does not hold writes forever
POLL_S = 0.01


class _Probe:
    prefilling: Callable[[], bool] = staticmethod(lambda: False)
    waiters = 0  # threads waiting for a write (disk.wait_written, flush): no pauses


_probe = _Probe()
_lock = threading.Lock()


def set_prefill_probe(prefilling: Callable[[], bool]) -> None:
    """`prefilling()`: whether some prompt is being prefilled now (any engine)."""
    _probe.prefilling = prefilling


def lower_priority() -> None:
    """The calling thread at WRITER_NICE (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return  # setpriority's PRIO_PROCESS names the whole process there
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except OSError as exc:
        log.debug("the prompt cache writer keeps its priority: %s", exc)


def pauser() -> Callable[[], None]:
    """A pause for one state's write: each call waits while a prompt prefills and
    nobody waits for the write, all calls together at most MAX_PAUSE_S."""
    deadline = time.monotonic() + MAX_PAUSE_S

    def pause() -> None:
        while not _probe.waiters and _probe.prefilling() and time.monotonic() < deadline:
            time.sleep(POLL_S)

    return pause


@contextmanager
def waited_for() -> Iterator[None]:
    """While open, the writer does not pause: someone waits for its writes (a
    disk-only lookup for its own state, whose worker holds the prefill)."""
    with _lock:
        _probe.waiters += 1
    try:
        yield
    finally:
        with _lock:
            _probe.waiters -= 1
