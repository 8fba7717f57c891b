"""Is this process one rank of several? Its group, and rank 0's address.

`mlx.launch` starts each rank with MLX_RANK and the backend's variables
(ring: MLX_HOSTFILE, a JSON list per rank of "ip:port"; JACCL:
MLX_JACCL_COORDINATOR and MLX_IBV_DEVICES). The same variables set by hand
work the same way.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_BACKEND_VARS = {
    "MLX_HOSTFILE": "ring",
    "MLX_JACCL_COORDINATOR": "jaccl",
    "MLX_IBV_DEVICES": "jaccl",
}


def launched_as_rank() -> bool:
    """Whether this process was started as a rank (by `mlx.launch` or by hand)."""
    return "MLX_RANK" in os.environ and any(os.environ.get(v) for v in _BACKEND_VARS)


def env_rank() -> int:
    """This process's rank as the launcher gave it (0 when not launched as a rank)."""
    try:
        return int(os.environ.get("MLX_RANK", "0"))
    except ValueError:
        return 0


def backend() -> str:
    for var, name in _BACKEND_VARS.items():
        if os.environ.get(var):
            return name
    return "any"


def init_group() -> Any:
    """Join the other ranks (blocks until every rank has joined)."""
    import mlx.core as mx

    name = backend()
    log.info("rank %d: joining the other ranks (%s backend)", env_rank(), name)
    return mx.distributed.init(strict=True, backend=name)


def coordinator_host() -> str:
    """Rank 0's IP address, where the watchdog listens."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            ranks = json.loads(Path(hostfile).read_text())
            return str(ranks[0][0]).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, TypeError) as exc:
            log.warning("cannot read rank 0's address from %s: %s", hostfile, exc)
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    return "127.0.0.1"
