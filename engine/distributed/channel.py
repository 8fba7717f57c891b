"""Rank 0's messages to the other ranks, through MLX's own collectives.

A message is JSON bytes. Ranks other than 0 do not know its length in
advance, so it travels in a fixed-size frame (the length in its first four
bytes) summed over the ranks: rank 0 contributes the bytes, the others
zeros. A longer message sends its remainder in a second sum. Every
collective runs on mlx-lm's generation stream, the stream the batch's
forward and its token broadcast run on, so each rank issues them in one order.

Once every rank's watchdog is connected, messages travel over its TCP
connections instead (the `post` side): a follower then waits for rank 0 in a
blocking socket read, not in MLX's ring receive, which polls (a core's worth
of CPU, taken from the other ranks when they share a machine, and burnt while
rank 0 waits for requests). Hidden states and tokens always go through MLX.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

FRAME = 2048  # bytes; a step's message (new requests aside) fits in one frame


class Post(Protocol):
    def post(self, number: int, message: Any) -> None: ...

    def take(self, number: int) -> Any: ...


@dataclass
class ChannelStats:
    messages: int = 0
    seconds: float = 0.0  # time in the broadcasts (on followers: waiting for rank 0)


class Channel:
    """Broadcasts JSON-able messages from rank 0 to every rank."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()
        self.stats = ChannelStats()
        self.post: Post | None = None  # set once every rank's watchdog is connected

    def send(self, message: Any) -> None:
        """Rank 0: broadcast `message`."""
        assert self.rank == 0
        if self.post is not None:
            start = time.perf_counter()
            self.post.post(self.stats.messages + 1, message)
            self._count(start)
            return
        self._exchange(json.dumps(message, separators=(",", ":")).encode())

    def receive(self) -> Any:
        """Ranks > 0: the next message from rank 0 (blocks until it comes)."""
        assert self.rank != 0
        if self.post is not None:
            start = time.perf_counter()
            message = self.post.take(self.stats.messages + 1)
            self._count(start)
            return message
        return json.loads(self._exchange(None))

    def _exchange(self, payload: bytes | None) -> bytes:
        start = time.perf_counter()
        frame = np.zeros(FRAME, dtype=np.uint8)
        if payload is not None:
            head = payload[: FRAME - 4]
            frame[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), dtype=np.uint8)
            frame[4 : 4 + len(head)] = np.frombuffer(head, dtype=np.uint8)
        got = self._sum(frame)
        length = int.from_bytes(got[:4].tobytes(), "little")
        data = got[4 : 4 + min(length, FRAME - 4)].tobytes()
        if length > FRAME - 4:
            rest = np.zeros(length - (FRAME - 4), dtype=np.uint8)
            if payload is not None:
                rest[:] = np.frombuffer(payload[FRAME - 4 :], dtype=np.uint8)
            data += self._sum(rest).tobytes()
        self._count(start)
        return data

    def _count(self, start: float) -> None:
        self.stats.messages += 1
        self.stats.seconds += time.perf_counter() - start

    def _sum(self, values: np.ndarray) -> np.ndarray:
        with mx.stream(generation_stream):
            out = mx.distributed.all_sum(mx.array(values), group=self.group)
            mx.eval(out)
        return np.array(out)
