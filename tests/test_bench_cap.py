"""`flashserve bench --sections cap --quick`: the quick MoE (or dense) GGUF written and
prepared, flashserve run in a real cgroup v1 group with --expert-cache auto (twice:
as served and with --prompt-matmul float; or --residency auto), its rows and its
targets printed (Linux, root)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashserve.engine.bench.cap.runs import CapRun, Turn, _measured
from flashserve.engine.bench.cap.section import prepared_bytes
from tests.conftest import _clean_env
from tests.test_bench import REPO, _number, _tables


def _need_cgroups() -> None:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the cap section creates cgroups: Linux, root")
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller")


def test_quick_cap_section_serves_in_a_cgroup_and_prints_its_row(tmp_path: Path) -> None:
    _need_cgroups()
    cmd = [sys.executable, "-m", "flashserve.server.cli", "bench", "--", "--quick"]
    cmd += ["--sections", "cap", "--cap", "400MB", "--rounds", "1", "--tokens", "8"]
    cmd += ["--work-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables = _tables(proc.stdout)
    cap = [rows for title, rows in tables.items() if title.startswith("Cap: cap-moe-quick")]
    assert len(cap) == 1, proc.stdout
    # As served (int16 prompt rows), and with --prompt-matmul float beside it.
    row, floats = cap[0]
    assert row["server"] == "flashserve" and row["OOM"] == "no", row
    assert floats["server"] == "flashserve (float prompt)" and floats["OOM"] == "no", floats
    assert _number(floats["TTFT s"]) > 0 and _number(floats["decode tok/s"]) > 0
    assert re.search(r"^  round 1: TTFT int16 / float prompt: \d+\.\d\dx$", proc.stdout, re.M)
    assert _number(row["prompt tokens"]) >= 100
    assert _number(row["TTFT s"]) > 0 and _number(row["decode tok/s"]) > 0
    assert 0 < _number(row["private MB"]) <= _number(row["peak private MB"]) <= 400
    assert _number(row["turn-1 decode tok/s"]) > 0
    assert _number(row["experts MB"]) > 0
    assert _number(row["cgroup peak MB"]) <= 400
    # The I/O bound: the disk's speed measured beside the decode, or just before the
    # server started where that was faster, / the bytes it read.
    assert _number(row["disk GB/s before"]) > 0 and _number(row["disk GB/s at decode"]) > 0
    assert _number(row["disk GB/s quiet"]) > 0
    if row["MB read/token"] not in ("-", "0"):
        disk = max(_number(row["disk GB/s at decode"]), _number(row["disk GB/s quiet"]))
        bound = disk * 1e3 / _number(row["MB read/token"])
        assert _number(row["I/O bound tok/s"]) == pytest.approx(bound, rel=0.15), row
    # The next turn resends the prompt and the answer: it reuses more than the prompt.
    assert _number(row["next reused"]) > _number(row["prompt tokens"])
    assert "next-turn TTFT / TTFT" in proc.stdout.split("Cap targets")[1]
    assert (tmp_path / "cap-moe-quick" / "cap-moe-quick.gguf").exists()


def test_quick_dense_cap_section_runs_uncapped_and_capped_and_prints_its_targets(
    tmp_path: Path,
) -> None:
    """`--cap-model dense`: the quick dense GGUF, flashserve with --residency auto with no
    limit (its own reference decode) and under a cap given as a fraction of the
    prepared model; rows and the dense targets printed."""
    _need_cgroups()
    cmd = [sys.executable, "-m", "flashserve.server.cli", "bench", "--", "--quick"]
    cmd += ["--sections", "cap", "--cap-model", "dense", "--cap", "27x", "--rounds", "1"]
    cmd += ["--tokens", "8", "--work-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables = _tables(proc.stdout)
    (rows,) = [rows for title, rows in tables.items() if title.startswith("Cap: cap-dense-quick")]
    assert [(r["server"], r["cap"]) for r in rows] == [
        ("flashserve", "none"),
        ("flashserve", "27.00x"),
    ]
    for row in rows:
        assert row["OOM"] == "no" and _number(row["decode tok/s"]) > 0, row
        assert _number(row["next reused"]) > _number(row["prompt tokens"])
    capped = rows[1]
    assert _number(capped["cgroup peak MB"]) <= 27 * _model_mb(tmp_path)
    resident, layers = (int(n) for n in capped["resident layers"].split("/"))
    assert rows[0]["resident layers"] == f"{layers}/{layers}" and resident <= layers
    # Where the plan streams layers (the tiny model may fit, and layers lent while
    # decode runs count as resident), they are read from disk per token and the I/O
    # bound is theirs; the uncapped run reads nothing.
    streams = _number(capped["MB read/token"]) >= 1
    assert (capped["I/O bound tok/s"] != "-") == streams, capped
    assert rows[0]["MB read/token"] == "0" and rows[0]["I/O bound tok/s"] == "-"
    assert "decode / uncapped" in proc.stdout.split("Cap targets, dense")[1]
    assert (tmp_path / "cap-dense-quick" / "cap-dense-quick.gguf").exists()


def _model_mb(work_dir: Path) -> float:
    manifest = work_dir / "cap-dense-quick" / "prepared" / "manifest.json"
    return prepared_bytes(json.loads(manifest.read_text())) / 1e6  # what the caps are of


def test_the_io_bound_divides_by_the_faster_of_the_disk_measurements() -> None:
    """The disk measured beside a decode may be slowed by the server's own work (its
    start, a prompt state written to the disk tier): the I/O bound then divides by the
    same measurement taken before the server started, never by a slower one."""
    turn = Turn(ttft=1.0, seconds=4.0, tokens=5, text="", read_bytes=4 * 10**9, cached=None,
                prompt_tokens=8)  # fmt: skip
    slowed = CapRun(server="s", round=1, oom=False, quiet_disk_bytes_per_s=4e9)
    _measured(slowed, turn, 2e9, 3e9)
    assert slowed.decode_disk_bytes_per_s == 2.5e9  # the mean beside the decode, as shown
    assert slowed.io_bound_tps == 4.0  # 4 GB/s over 1 GB a token
    quiet = CapRun(server="s", round=1, oom=False, quiet_disk_bytes_per_s=2e9)
    _measured(quiet, turn, 3e9, 3e9)
    assert quiet.io_bound_tps == 3.0
