"""Rank 0's messages to the other ranks: JSON lines over the watchdog's connections.

Each worker step, rank 0 tells the other ranks what changed in the batch
(mirror.py) and followers replay it (follower.py). The messages travel over
the watchdog's TCP connections (watchdog.py), numbered, not through MLX: a
follower then waits for rank 0 in a blocking socket read. In MLX's ring
receive it would poll its socket, a core's worth of CPU burnt while rank 0
waits for requests and taken from the other ranks when they share a machine.
Hidden states and tokens, which the forward needs, always go through MLX.

Before the watchdog is connected the ranks know only MLX's group, so rank 0's
watchdog port goes to the others as one integer summed over the ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx


class Post(Protocol):
    def post(self, number: int, message: Any) -> None: ...

    def take(self, number: int) -> Any: ...


@dataclass
class ChannelStats:
    messages: int = 0
    seconds: float = 0.0  # time sending (rank 0) or waiting for rank 0 (followers)


class Channel:
    """Numbered JSON-able messages from rank 0 to every other rank."""

    def __init__(self, rank: int, post: Post) -> None:
        self.rank = rank
        self.post = post
        self.stats = ChannelStats()

    def send(self, message: Any) -> None:
        """Rank 0: send `message` to every other rank."""
        assert self.rank == 0
        start = time.perf_counter()
        self.post.post(self.stats.messages + 1, message)
        self._count(start)

    def receive(self) -> Any:
        """Ranks > 0: the next message from rank 0 (blocks until it comes)."""
        assert self.rank != 0
        start = time.perf_counter()
        message = self.post.take(self.stats.messages + 1)
        self._count(start)
        return message

    def _count(self, start: float) -> None:
        self.stats.messages += 1
        self.stats.seconds += time.perf_counter() - start


def share_from_rank0(group: Any, value: int) -> int:
    """Rank 0's `value` on every rank (the others pass 0): one sum over the ranks."""
    total = mx.distributed.all_sum(mx.array([value], dtype=mx.int32), group=group)
    return int(total.item())
