"""`flashserve bench --sections cap`: a model larger than a real cgroup memory limit.

- `section`  the section: its models (an MoE, a dense model), the limits, rounds
             against llama-server, the table and the targets.
- `runs`     one server run alone in a cgroup v1 memory group, timed and measured.
"""

from flashserve.engine.bench.cap.section import parse_cap, run

__all__ = ["parse_cap", "run"]
