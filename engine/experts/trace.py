"""Routing traces: which experts each token used, one JSON line per token and layer.

Lines of a prompt's prefill call carry `"prefill": true`: such a call never
evicts from the cache (experts/prefill.py), and a replay must know it.

`--record-routing FILE` writes one while serving; experts/replay.py replays it
against cache policies and sizes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

import numpy as np


class RoutingTrace:
    """Writes (forward, token, layer, expert ids) as JSON lines."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One trace per run: a new server start begins a new file.
        self._file: TextIO | None = open(self.path, "w", buffering=1 << 16)  # noqa: SIM115

    def write(
        self, forward: int, first_token: int, layer: int, ids: np.ndarray, prefill: bool = False
    ) -> None:
        """`prefill`: the call was a prompt's (experts/prefill.py: the cache only fills)."""
        if self._file is None:
            return
        rows = ids.reshape(-1, ids.shape[-1]).tolist()
        extra = {"prefill": True} if prefill else {}
        lines = [
            json.dumps(
                {
                    "fwd": forward,
                    "token": first_token + r,
                    "layer": layer,
                    "experts": sorted(row),
                    **extra,
                },
                separators=(",", ":"),
            )
            for r, row in enumerate(rows)
        ]
        self._file.write("\n".join(lines) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
