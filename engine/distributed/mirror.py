"""Rank 0's side: the worker's batch, announced to the other ranks.

The worker drives mlx-lm's BatchGenerator as it always does; in a split model
the batch it gets is a `MirroredBatch`. Inserts and removals are applied at
once and queued; `next()` first broadcasts them with the step (channel.py),
so each follower (follower.py) runs the same operations on its own batch, in
the same order, and the batch's forward runs on every rank at once.

Sampling happens on rank 0 only, with the request's processors (penalties,
grammars) and RNG: each sampler's tokens are summed over the ranks, the
others contributing zeros, so every rank's batch sees rank 0's tokens and
ends the same sequences at the same step. Rank 0's one shared greedy sampler
stays one sampler (one batched call), and so does the followers'.

What the followers cannot replay is refused as a client error (`refusal`):
requests prefilled outside the batch (n > 1, prompt logprobs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from flashserve.engine import loader
from flashserve.engine.config import EngineConfig
from flashserve.engine.distributed import group as groups
from flashserve.engine.distributed import node
from flashserve.engine.distributed.node import Node
from flashserve.engine.distributed.watchdog import fatal
from flashserve.engine.weights.model import LoadedModel, ModelLoadError

log = logging.getLogger(__name__)

Sampler = Callable[[mx.array], mx.array]


def load_model(config: EngineConfig) -> tuple[LoadedModel, Mirror | None]:
    """The worker's model: all of it, or, when this process is rank 0 of several,
    its share (node.py) and the Mirror that keeps the other ranks in step."""
    if not groups.launched_as_rank():
        return loader.load(config), None
    if groups.env_rank() != 0:
        raise ModelLoadError("only rank 0 runs the worker; other ranks follow (follower.py)")
    this = node.start(config)
    assert this.loaded is not None
    return this.loaded, Mirror(this)


def broadcast_sampler(sampler: Sampler, group: Any) -> Sampler:
    """Rank 0: `sampler`'s tokens, sent to every rank (all_sum with their zeros)."""

    def sample(logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(sampler(logprobs), group=group)

    return sample


def receiving_sampler(group: Any) -> Sampler:
    """Ranks > 0: rank 0's tokens. The zeros depend on this rank's logits, so the
    sum comes after this step's transfers, as on rank 0."""

    def sample(logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(mx.argmax(logprobs, axis=-1) * 0, group=group)

    return sample


def batch_options(batch: Any) -> dict[str, Any]:
    """The BatchGenerator settings a follower's batch must share."""
    return {
        "completion_batch_size": batch.completion_batch_size,
        "prefill_batch_size": batch.prefill_batch_size,
        "prefill_step_size": batch.prefill_step_size,
        "max_kv_size": batch.max_kv_size,
    }


class Mirror:
    """Rank 0's link to the followers, held by the worker (`Engine.mirror`)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pending: list[list[Any]] = []
        self._shared = broadcast_sampler(greedy_sampler, node.group)

    def wrap(self, batch: Any) -> MirroredBatch:
        self.pending.append(["new_batch", batch_options(batch)])
        return MirroredBatch(batch, self)

    @staticmethod
    def refusal(request: Any) -> tuple[str, str] | None:
        """(message, parameter) when the request needs what a split model lacks."""
        if request.n > 1:
            return "n > 1 is not available while the model is split across ranks", "n"
        if request.prompt_logprobs is not None or request.max_tokens == 0:
            return "prompt logprobs (echo) are not available while the model is split", "echo"
        if request.images:  # prefilled outside the batch, which the ranks do not mirror
            return "images are not available while the model is split across ranks", "messages"
        return None

    def sampler(self, sampler: Sampler) -> tuple[Sampler, str]:
        if sampler is greedy_sampler:  # the worker's greedy requests share it
            return self._shared, "shared"
        return broadcast_sampler(sampler, self.node.group), "own"

    def step(self) -> None:
        """Announce the pending operations and one step of the batch."""
        message = {"ops": self.pending, "step": True}
        self.pending = []
        self.node.channel.send(message)

    def close(self) -> None:
        """Rank 0 stops: the followers end (exit 0) after this message."""
        self.node.watchdog.goodbye()
        self.node.channel.send({"ops": [*self.pending, ["shutdown"]], "step": False})
        self.pending = []

    def report(self) -> dict[str, Any]:
        """Each rank's layers and memory (rank 0's now, the others' last heartbeat)."""
        node = self.node
        ranks = [node.status()] + [
            node.watchdog.peers.get(r, {"rank": r}) for r in range(1, node.size)
        ]
        return {
            "size": node.size,
            "backend": groups.backend(),
            "ranks": ranks,
            "messages": node.channel.stats.messages,
            "message_seconds_total": node.channel.stats.seconds,
        }

    def numbers(self) -> dict[str, Any]:
        """For /metrics: rank 0's transfer time (per step) and message counters."""
        stats = self.node.pipeline.stats.to_dict() if self.node.pipeline else {}
        return {
            "ranks": self.node.size,
            **stats,
            "messages_total": self.node.channel.stats.messages,
            "message_seconds_total": self.node.channel.stats.seconds,
        }


class MirroredBatch:
    """A BatchGenerator whose operations rank 0's followers replay."""

    def __init__(self, batch: Any, mirror: Mirror) -> None:
        self._batch = batch
        self._mirror = mirror

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def insert(
        self,
        prompts: list[list[int]],
        max_tokens: list[int] | None = None,
        caches: list[Any] | None = None,
        all_tokens: list[list[int]] | None = None,
        samplers: list[Any] | None = None,
        logits_processors: list[Any] | None = None,
        stop_sequences: list[Any] | None = None,
    ) -> list[int]:
        if caches is not None and any(c is not None for c in caches):
            # Only a prompt-cache hit or a prefill outside the batch brings one; both are off.
            raise RuntimeError("a prefilled cache cannot be replayed on the other ranks")
        given = samplers or [self._batch.sampler] * len(prompts)
        pairs = [self._mirror.sampler(s) for s in given]
        uids = self._batch.insert(
            prompts,
            max_tokens,
            caches,
            all_tokens,
            [p[0] for p in pairs],
            logits_processors,
            stop_sequences,
        )
        self._mirror.pending.append(
            ["insert", list(uids), prompts, max_tokens, all_tokens, [p[1] for p in pairs]]
        )
        return uids

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> Any:
        self._mirror.pending.append(["remove", list(uids)])
        return self._batch.remove(uids, return_prompt_caches)

    def next(self) -> Any:
        stats = self._mirror.node.pipeline.stats
        self._mirror.step()
        stats.begin_step()
        try:
            out = self._batch.next()
        except Exception as exc:
            # The followers are mid-step and cannot take back what they ran: a
            # failed step ends every rank, with the reason.
            log.exception("batch step failed on rank 0")
            fatal(f"a batch step failed on rank 0 ({exc}); every rank stops", code=1)
        stats.end_step()
        return out
