"""One rank's setup: join the group, start the watchdog, load, take a layer range.

Every rank loads the model the same way (the same settings reach every rank),
then keeps only its own layers' weights (pipeline.py). Two features stay off
when the model is split: the prompt cache (a restored state would have to
match on every rank) and layer-major prefill (it cancels mid-prefill on one
rank only); both are per-rank decisions the followers cannot replay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from flashserve.engine.config import EngineConfig
from flashserve.engine.distributed import group as groups
from flashserve.engine.distributed.channel import Channel, share_from_rank0
from flashserve.engine.distributed.pipeline import Pipeline, install, num_layers
from flashserve.engine.distributed.ranges import LayerSplitError, split_layers
from flashserve.engine.distributed.watchdog import Watchdog
from flashserve.engine.loader import load
from flashserve.engine.streaming.memory import mlx_memory, process_rss
from flashserve.engine.weights.model import LoadedModel, ModelLoadError

log = logging.getLogger(__name__)


@dataclass
class Node:
    """This process as one rank of the pipeline."""

    group: Any  # mx.distributed.Group
    rank: int
    size: int
    config: EngineConfig
    channel: Channel
    watchdog: Watchdog
    loaded: LoadedModel | None = None
    pipeline: Pipeline | None = None

    def status(self) -> dict[str, Any]:
        """This rank's layers and memory (what /memory shows per rank)."""
        out: dict[str, Any] = {"rank": self.rank, "rss_bytes": process_rss()}
        out["mlx_active_bytes"] = mlx_memory().active
        if self.pipeline is not None:
            layers = self.pipeline.layers
            out["layers"] = [layers.start, layers.stop - 1]
            out["layer_weight_bytes"] = self.pipeline.owned_weight_bytes
            out["transfer"] = self.pipeline.stats.to_dict()
        return out


def start(config: EngineConfig) -> Node:
    """Join the other ranks, connect the watchdog, load this rank's share."""
    group = groups.init_group()
    rank, size = group.rank(), group.size()
    # Per-rank decisions the other ranks could not replay (the module doc says why).
    if config.prompt_cache_bytes or config.prefill_order != "chunked":
        log.info("model split across %d ranks: prompt cache and layer-major prefill are off", size)
    config.prompt_cache_bytes = 0
    config.prompt_cache_disk_bytes = 0
    config.prefill_order = "chunked"
    watchdog = Watchdog(rank, size, lambda: node.status())
    node = Node(group, rank, size, config, Channel(rank, watchdog), watchdog)
    # The watchdog's port is rank 0's to choose.
    if rank == 0:
        share_from_rank0(group, watchdog.listen(groups.coordinator_host()))
    else:
        watchdog.connect(groups.coordinator_host(), share_from_rank0(group, 0))
    loaded = load(config)
    try:
        ranges = split_layers(num_layers(loaded.model), size, config.layer_split)
    except LayerSplitError as exc:
        raise ModelLoadError(str(exc)) from None
    node.pipeline = install(loaded.model, group, ranges)
    node.loaded = loaded
    if rank == 0:
        watchdog.wait_connected()  # a message must reach every rank
        watchdog.wait_peers(lambda status: "layers" in status)
    else:
        watchdog.beat_now()  # rank 0 waits for this rank's layers
    mx.clear_cache()
    return node
