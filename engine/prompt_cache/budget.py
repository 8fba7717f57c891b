"""The disk tier's write budget: bytes per hour, so one busy agent cannot wear an SSD out.

A sliding window over the last hour. A state whose file would go past the
budget is not written (the disk tier counts it as dropped); it is still in
the memory tier.
"""

from __future__ import annotations

import threading
import time
from collections import deque

_HOUR_S = 3600.0


class WriteBudget:
    """At most `bytes_per_hour` bytes written in any hour; 0 means no cap."""

    def __init__(self, bytes_per_hour: int) -> None:
        self.bytes_per_hour = int(bytes_per_hour)
        self._lock = threading.Lock()
        self._spent: deque[tuple[float, int]] = deque()  # (monotonic time, bytes)
        self._total = 0

    def allows(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit in the last hour's budget."""
        if self.bytes_per_hour <= 0:
            return True
        return self.last_hour() + nbytes <= self.bytes_per_hour

    def spend(self, nbytes: int) -> None:
        with self._lock:
            self._spent.append((time.monotonic(), int(nbytes)))
            self._total += int(nbytes)

    def last_hour(self) -> int:
        """Bytes written in the last hour."""
        with self._lock:
            horizon = time.monotonic() - _HOUR_S
            while self._spent and self._spent[0][0] < horizon:
                self._total -= self._spent.popleft()[1]
            return self._total
