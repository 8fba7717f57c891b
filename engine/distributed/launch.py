"""`flashserve serve --hostfile hosts.json`: start every rank through `mlx.launch`.

The hostfile is `mlx.launch`'s JSON: one entry per rank, in rank order, e.g.
`[{"ssh": "mac1.local", "ips": ["192.168.1.10"]}, {"ssh": "mac2.local",
"ips": ["192.168.1.11"]}]`. Each rank runs the same `flashserve serve`
command line (without --hostfile); rank 0 serves HTTP, the others follow.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

BACKENDS = ("ring", "jaccl", "jaccl-ring")

# mlx.launch's own entry point (its console script may not be on PATH). It
# ignores SIGTERM and SIGINT, and so do the ranks it starts unless they set
# their own: rank 0's server drains on SIGTERM, the others end with it, and the
# launcher when every rank has.
# Its I/O loops wait in select() on the ranks' stdin pipes, always writable,
# and on its own stdin, always readable at EOF: they spin, taking most of a
# core from the ranks. flashserve sends the ranks no input, so its select()
# waits for their output only.
_LAUNCHER = """
import select, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
from mlx._distributed_utils import launch
def output_only(rlist, wlist, xlist, timeout=None):
    return select.select([fd for fd in rlist if fd != 0], [], xlist, timeout)
launch.select = output_only
sys.exit(launch.main())
"""


class HostfileError(ValueError):
    """The hostfile cannot be used; the message says why."""


def check_hostfile(path: str | Path) -> list[dict]:
    """The hostfile's entries, or HostfileError naming what is wrong."""
    try:
        hosts = json.loads(Path(path).read_text())
    except OSError as exc:
        raise HostfileError(f"hostfile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise HostfileError(f"hostfile {path}: not JSON ({exc})") from None
    if isinstance(hosts, dict):  # mlx.launch also takes {"backend": ..., "hosts": [...]}
        hosts = hosts.get("hosts")
    if not isinstance(hosts, list) or len(hosts) < 2:
        raise HostfileError(f"hostfile {path}: expected a JSON list of at least two hosts")
    for i, host in enumerate(hosts):
        if not isinstance(host, dict) or not isinstance(host.get("ssh"), str):
            raise HostfileError(f'hostfile {path}: host {i} needs an "ssh" name')
        ips = host.get("ips", [])
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise HostfileError(f'hostfile {path}: host {i}: "ips" must be a list of strings')
    return hosts


def launch_command(
    hostfile: str | Path,
    serve_args: Sequence[str],
    *,
    backend: str = "ring",
    port: int = 32323,
    python: str | None = None,
) -> list[str]:
    """The `mlx.launch` command line that runs `flashserve serve serve_args` on every rank."""
    if backend not in BACKENDS:
        raise HostfileError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    check_hostfile(hostfile)
    python = python or sys.executable
    return [
        python,
        "-c",
        _LAUNCHER,
        "--backend",
        backend,
        "--hostfile",
        str(hostfile),
        "--starting-port",
        str(port),
        "--python",
        python,
        "--",
        "-m",
        "flashserve.server.cli",
        "serve",
        *serve_args,
    ]
