"""`flashserve bench --plot DIR` around the sections (tests/test_bench.py runs the real
quick bench with --plot and checks its PNGs): matplotlib missing is said before any
section runs, and a section that did not run draws no figure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flashserve.engine.bench import plots, runner


def test_missing_matplotlib_is_refused_before_any_section(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_info:
        runner.main(["--quick", "--work-dir", str(tmp_path / "work"), "--plot", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "pip install 'flashserve[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # no section ran


def test_only_the_sections_that_ran_are_drawn(tmp_path: Path) -> None:
    rows = [
        {"configuration": name, "streams": n, "tokens_per_s": 10.0 * n}
        for name in ("resident", "0% residency")
        for n in (1, 2, 4, 8)
    ]
    prompt_cache = [
        {
            "residency": "100%",
            "turn": n,
            "prompt_tokens": 40 * n,
            "cold_s": 0.1 * n,
            "memory_hit_s": 0.01,
            "disk_hit_s": 0.02,
        }
        for n in (1, 2, 3)
    ]
    written = plots.write(tmp_path / "out", {"batch": {"rows": rows}, "prompt-cache": prompt_cache})
    assert sorted(p.name for p in written) == ["batch.png", "ttft.png"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["batch.png", "ttft.png"]
    for path in written:
        assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 10_000
