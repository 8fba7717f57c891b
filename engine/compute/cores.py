"""How many cores this process may compute on: its CPU affinity, capped by a cgroup CPU quota.

A container given `--cpus 2` on a 16-core host sees 16 cores in its
affinity mask but is throttled to two cores' worth of time: sixteen threads
there each run an eighth of the time and wait on each other. So the count is
the affinity mask's size, capped by the quota (rounded up: a quota of 1.5
cores still gains from a second thread). Prefill's BLAS threads
(compute/blas.py) and the decode kernel's pool (compute/qmm.py) take this
many.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux; macOS has no affinity masks
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _own_cgroup_dirs(root: Path) -> list[Path]:
    """This process's cgroup folders (v2's unified one, v1's cpu controller's), then the root."""
    dirs: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # v2
            dirs.append(root / rel)
        elif "cpu" in controllers.split(","):  # v1: cpu,cpuacct
            for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                dirs.append(root / name / rel)
    dirs.append(root)
    for name in ("cpu,cpuacct", "cpu"):
        dirs.append(root / name)
    return dirs


def quota_cores(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup CPU quota in cores (v2 cpu.max; v1 cfs_quota_us / cfs_period_us), or None."""
    for folder in _own_cgroup_dirs(root):
        try:
            fields = (folder / "cpu.max").read_text().split()
            if fields and fields[0] != "max" and len(fields) >= 2:
                return int(fields[0]) / int(fields[1])
            if fields:
                return None
        except (OSError, ValueError):
            pass
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
            return quota / period if quota > 0 and period > 0 else None
        except (OSError, ValueError):
            pass
    return None


def usable(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may use: the affinity mask, capped by the cgroup quota (rounded up)."""
    cores = _affinity()
    quota = quota_cores(root)
    if quota is not None and quota > 0:
        cores = min(cores, max(1, math.ceil(quota - 1e-9)))
    return cores
