"""Ranks > 0: replay rank 0's batch, step by step, until rank 0 says stop.

Each message from rank 0 (mirror.py) lists the batch operations since the
last step (a new batch, inserts with their prompts and limits, removals) and
whether to step. The follower applies them to its own BatchGenerator over its
own share of the model; inserts must get the uids rank 0's got, or the ranks
no longer agree and every rank stops.
"""

from __future__ import annotations

import logging
from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences

from flashserve.engine.distributed.mirror import receiving_sampler
from flashserve.engine.distributed.node import Node
from flashserve.engine.distributed.watchdog import fatal

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, node: Node) -> None:
        assert node.loaded is not None and node.pipeline is not None
        self.node = node
        self.model = node.loaded.model
        eos = node.loaded.tokenizer.eos_token_ids
        # The worker's stop sequences: the model's end-of-sequence tokens.
        self.stops = StopSequences([[t] for t in eos])
        self.shared = receiving_sampler(node.group)
        self.batch: Any = None

    def run(self) -> int:
        """Follow until rank 0 shuts down; the exit code (0)."""
        log.info("rank %d follows rank 0", self.node.rank)
        while True:
            message = self.node.channel.receive()
            for op in message.get("ops", []):
                if op[0] == "shutdown":
                    self.node.watchdog.closing = True
                    log.info("rank 0 shut down; rank %d stops", self.node.rank)
                    return 0
                self._apply(op)
            if message.get("step"):
                self._step()

    def _apply(self, op: list[Any]) -> None:
        kind = op[0]
        if kind == "new_batch":
            self.batch = BatchGenerator(self.model, **op[1])
        elif kind == "insert":
            _, uids, prompts, max_tokens, all_tokens, kinds = op
            samplers = [
                self.shared if k == "shared" else receiving_sampler(self.node.group) for k in kinds
            ]
            got = self.batch.insert(
                prompts,
                max_tokens,
                None,
                all_tokens,
                samplers,
                None,
                [self.stops] * len(prompts),
            )
            if list(got) != list(uids):
                fatal(f"rank {self.node.rank} is out of step with rank 0 (uids {got} != {uids})")
        elif kind == "remove":
            self.batch.remove(op[1])
        else:
            fatal(f"rank {self.node.rank}: unknown operation from rank 0: {kind!r}", code=1)

    def _step(self) -> None:
        stats = self.node.pipeline.stats
        stats.begin_step()
        try:
            self.batch.next()
        except Exception as exc:
            log.exception("batch step failed on rank %d", self.node.rank)
            fatal(f"a batch step failed on rank {self.node.rank} ({exc}); every rank stops", 1)
        stats.end_step()


def follow(node: Node) -> int:
    return Follower(node).run()
