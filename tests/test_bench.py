"""`flashserve bench --quick`: the real command, in a subprocess, on tiny models.

A smoke test of the benchmark's plumbing, not of its numbers (the machine is
shared): every section runs, every table prints with numbers where numbers
belong, and the targets block reports a ratio for each target.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, _clean_env

TIMEOUT_S = 90


def _tables(output: str) -> dict[str, list[dict[str, str]]]:
    """Markdown tables printed by the bench: title line -> rows as {header: cell}."""
    tables: dict[str, list[dict[str, str]]] = {}
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("| ") or i == 0 or lines[i - 1].startswith("|"):
            continue
        header = [c.strip() for c in line.strip("|").split("|")]
        rows = []
        for row_line in lines[i + 2 :]:
            if not row_line.startswith("|"):
                break
            rows.append(
                dict(zip(header, (c.strip() for c in row_line.strip("|").split("|")), strict=True))
            )
        tables[lines[i - 1]] = rows
    return tables


def _number(cell: str) -> float:
    return float(cell)  # raises on anything that is not a number


def test_quick_bench_prints_every_section(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "flashserve.server.cli",
        "bench",
        "--",
        "--quick",
        "--sections",
        "layers,experts,batch,prefill,prompt-cache,io,distributed",
        "--tokens",
        "4",
        "--work-dir",
        str(tmp_path),
        "--plot",
        str(tmp_path / "plots"),
    ]
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert elapsed < TIMEOUT_S
    tables = _tables(proc.stdout)

    layer_tables = {t: rows for t, rows in tables.items() if t.startswith("Layer streaming:")}
    assert len(layer_tables) == 2, proc.stdout  # the default model and a random llama
    for title, rows in layer_tables.items():
        names = [(r["configuration"], r["prefetch"]) for r in rows]
        assert names[0] == ("plain mlx-lm", "-")
        for pct in ("100%", "75%", "50%", "25%", "0%"):
            assert (f"streaming {pct}", "on") in names and (f"streaming {pct}", "off") in names
        for row in rows:
            assert _number(row["tokens/s"]) > 0, (title, row)
            assert _number(row["peak MiB"]) > 0, (title, row)
            disk = row["disk read MiB/pass"]
            assert disk == "-" or _number(disk) >= 0  # "-" where /proc/self/io is missing
            if row["configuration"] in ("plain mlx-lm", "streaming 100%"):
                assert row["I/O bound tok/s"] == "-"
            else:
                assert _number(row["streamed MiB/token"]) > 0
                assert _number(row["I/O bound tok/s"]) > 0
                assert _number(row["x I/O bound"]) > 0
        # Fewer resident layers stream more bytes per token.
        streamed = [_number(r["streamed MiB/token"]) for r in rows if r["prefetch"] == "on"]
        assert streamed == sorted(streamed) and streamed[0] == 0 < streamed[-1]

    layer_targets = proc.stdout.split("Layer streaming targets")[1].split("\n\n")[0]
    targets = re.findall(
        r"^  .*: ([0-9.]+)x \(target >= ([0-9.]+)x\) (met|MISSED)$", layer_targets, re.MULTILINE
    )
    assert len(targets) == 2 * 5, proc.stdout  # five targets per model
    assert all(float(got) > 0 for got, _, _ in targets)

    experts = [rows for t, rows in tables.items() if t.startswith("MoE expert cache")]
    assert len(experts) == 1, proc.stdout
    assert len(experts[0]) >= 2
    assert all(_number(row["tokens/s"]) > 0 for row in experts[0])

    batch = [rows for t, rows in tables.items() if t.startswith("Batched decode")]
    assert len(batch) == 1, proc.stdout
    seen = {(r["configuration"], r["streams"]) for r in batch[0]}
    for config in ("resident", "0% residency", "25% expert cache"):
        for streams in ("1", "2", "4", "8"):
            assert (config, streams) in seen
    for row in batch[0]:
        assert _number(row["tokens/s"]) > 0
        if row["streams"] == "1":
            assert _number(row["x one stream"]) == 1.0
        # Streamed: a step loads each of the model's 4 layers once for the whole batch
        # (twice when it also prefills a newly admitted prompt), not once per stream.
        if row["configuration"] == "0% residency":
            assert 4 <= _number(row["layer loads/step"]) <= 8, row
    batch_targets = re.findall(
        r"^  (\d) streams / 1 stream: ([0-9.]+)x \(target >= ([0-9.]+)x\)",
        proc.stdout,
        re.MULTILINE,
    )
    assert [t[0] for t in batch_targets] == ["4", "8"], proc.stdout

    prefill = [rows for t, rows in tables.items() if t.startswith("Prefill:")]
    assert len(prefill) == 1, proc.stdout
    assert [r["prompt tokens"] for r in prefill[0]] == ["16", "64"]
    for row in prefill[0]:
        for column in ("kernel tok/s", "dequantize + BLAS tok/s", "speed-up"):
            assert _number(row[column]) > 0, row
    io = [rows for t, rows in tables.items() if t.startswith("Read paths at disk speed")]
    assert len(io) == 1, proc.stdout
    assert len(io[0]) == 6
    for row in io[0]:
        value, unit = row["measured"].split()
        assert _number(value) > 0 and unit in ("GB/s", "tok/s"), row
        assert _number(row["disk GB/s"]) > 0 and _number(row["ratio"]) > 0, row
    io_targets = proc.stdout.split("Read path targets")[1].split("(took")[0]
    assert len(re.findall(r"x \(target >= 0\.[89]0x\) (met|MISSED)$", io_targets, re.M)) == 6
    dist = [rows for t, rows in tables.items() if t.startswith("Distributed:")]
    assert len(dist) == 1, proc.stdout
    assert [r["ranks"] for r in dist[0]] == ["1", "2"]
    for row in dist[0]:
        assert _number(row["tokens/s"]) > 0 and _number(row["TTFT s"]) > 0, row
    assert dist[0][0]["rank 0 transfer ms/step"] == "-"
    assert _number(dist[0][1]["rank 0 transfer ms/step"]) > 0  # read from the 2-rank /metrics
    assert re.search(
        r"^float matmuls on the (mkl|reference|accelerate) BLAS$", proc.stdout, re.MULTILINE
    ), proc.stdout

    offloaded = [rows for t, rows in tables.items() if t.startswith("Prefill from disk")]
    assert len(offloaded) == 1, proc.stdout
    labels = ("dense f32, 0% resident", "MoE f32, 10% expert cache", "MoE f32, 25% expert cache")
    assert [(r["model"], r["prompt tokens"]) for r in offloaded[0]] == [
        (label, str(n)) for label in labels for n in (64, 160)
    ]
    for row in offloaded[0]:
        assert _number(row["bound s"]) >= _number(row["one pass / disk s"]) > 0, row
        # One read of each streamed layer or needed expert per prefill (the dense row's
        # pass is exact; an MoE prompt needs some of the experts), and fewer than chunked.
        assert 0 < _number(row["read / one pass"]) <= 1.0, row
        if row["prompt tokens"] == "160":  # 5 chunks of 32
            assert _number(row["chunked read / one pass"]) > _number(row["read / one pass"]), row
    major = [rows for t, rows in tables.items() if t.startswith("Expert-major prefill compute")]
    assert len(major) == 1, proc.stdout
    assert [(r["model"].split(",")[0], r["threads"].split(" ", 1)[1]) for r in major[0]] == [
        ("expert-major", "cores"),
        ("expert-major", "cores, template, two experts at a time"),
        ("expert-major", "cores, template, one expert at a time"),
        ("expert-major", "thread"),
        ("every expert resident", "cores"),
        ("every expert resident", "thread"),
    ]
    for row in major[0]:
        assert _number(row["prompt tok/s"]) > 0 and _number(row["cores busy"]) > 0, row
        assert _number(row["CPU spread"]) >= 1.0, row  # CPU time / the busiest thread's
    for ratio in (
        " / resident, all cores",
        ", one op per expert / template two at once",
        ", two experts at once / one at a time",
    ):
        line = rf"^  expert-major{re.escape(ratio)}, prompt tok/s: [0-9.]+x$"
        assert re.search(line, proc.stdout, re.M), ratio
    kept = [rows for t, rows in tables.items() if t.startswith("Expert cache (25%)")]
    assert len(kept) == 1 and _number(kept[0][0]["after / before"]) >= 0.95, proc.stdout
    assert len(re.findall(r"\(target (<=|>=) [0-9.]+x\) (met|MISSED)$", proc.stdout, re.M)) >= 7

    cache = [rows for t, rows in tables.items() if t.startswith("Prompt cache: time to")]
    assert len(cache) == 1, proc.stdout
    written = [rows for t, rows in tables.items() if t.startswith("Prompt cache: SSD bytes")]
    assert len(written) == 1 and written[0], proc.stdout
    for row in written[0]:
        # The disk tier writes only the tokens a turn adds (issue 42): at most 1.2x their KV.
        assert 0 < _number(row["written / new KV"]) <= 1.2, row
    assert [(r["residency"], r["turn"]) for r in cache[0]] == [
        (res, str(n)) for res in ("100%", "0%") for n in (1, 2, 3)
    ]
    for row in cache[0]:
        # Times of the tiny model may print as 0.00 s; the ratios come from unrounded times.
        for column in ("cold s", "memory hit s", "disk hit s"):
            assert _number(row[column]) >= 0, row
        for column in ("memory / cold", "disk / cold"):
            assert _number(row[column]) > 0, row
        # Turn n reuses the n - 1 earlier turns (40 tokens each), from memory and from disk.
        reused = 40 * (int(row["turn"]) - 1)
        assert _number(row["reused (memory)"]) == _number(row["reused (disk)"]) == reused, row
        streamed = row["residency"] == "0%"
        assert (_number(row["weights MB cold"]) > 0) == streamed, row
    cache_targets = re.findall(
        r"^  (100%|0%) residency, (memory hit|disk hit after restart) / cold: [0-9.]+x "
        r"\(target <= (0.15|0.3)x\) (met|MISSED)$",
        proc.stdout,
        re.MULTILINE,
    )
    assert len(cache_targets) == 4, proc.stdout
    assert re.search(r"last-turn memory hit reads \d+ MB of weights", proc.stdout)

    # --plot: one PNG per figure, each a real picture (engine/bench/plots.py).
    for name in ("residency.png", "expert_cache.png", "ttft.png", "batch.png"):
        png = tmp_path / "plots" / name
        assert f"plot: {png}" in proc.stdout
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 20_000, name


def test_quick_decode_section_prints_both_kernels_and_its_targets(tmp_path: Path) -> None:
    """The decode section (the default model): both kernels, llama.cpp where installed;
    the kv_bits rows against the float cache."""
    cmd = [sys.executable, "-m", "flashserve.server.cli", "bench", "--", "--quick"]
    cmd += ["--sections", "decode", "--tokens", "4", "--work-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables = _tables(proc.stdout)
    decode = [rows for t, rows in tables.items() if t.startswith("Decode: default model")]
    assert len(decode) == 1, proc.stdout
    kernels = {(r["kernel"], r["streams"]) for r in decode[0]}
    for kernel in ("flashserve kernel", "MLX kernel"):  # CI builds the fast path
        assert {(kernel, "1"), (kernel, "2")} <= kernels, kernels
    for row in decode[0]:
        assert _number(row["tokens/s"]) > 0, row
    targets = proc.stdout.split("Decode targets")[1]
    assert re.search(r"^  2 streams / 1 stream: [0-9.]+x \(target >= 2.5x\)", targets, re.M)
    assert re.search(r"^  1 stream / llama.cpp( 1 stream: [0-9.]+x|: not measured)", targets, re.M)
    compiled = re.search(r"compiled step / step built by Python: ([0-9.]+)x", targets)
    assert compiled and float(compiled.group(1)) > 0, targets
    assert ("flashserve kernel, float x", "1") in kernels, kernels  # decode_matmul "float"
    int16 = re.search(r"decode_matmul int16 / float: ([0-9.]+)x", targets)
    assert int16 and float(int16.group(1)) > 0, targets
    # kv_bits (issue 57): float, 8 and 4 bits as served and as before, at a 4k context.
    kv = [rows for t, rows in tables.items() if t.startswith("Decode with kv_bits")]
    assert len(kv) == 1, proc.stdout
    assert {r["cache"] for r in kv[0]} >= {"float", "kv_bits 8", "kv_bits 4"}, kv[0]
    assert all(r["context"] == "4096" and _number(r["tokens/s"]) > 0 for r in kv[0]), kv[0]
    for bits in (8, 4):
        line = rf"^  kv_bits {bits} / float at 4096 tokens: [0-9.]+x \(target >= 0.9x\)"
        assert re.search(line, proc.stdout, re.M), proc.stdout


def test_quick_agent_turn_section_prints_its_rows_and_bounds(tmp_path: Path) -> None:
    """The agent-turn section (the default model): cold prefill on every core and on one
    thread with cores busy, at 100% and 0% residency; the agent turn beside its bound; a
    llama-server row only when a binary is given (here none: the row says so)."""
    cmd = [sys.executable, "-m", "flashserve.server.cli", "bench", "--", "--quick"]
    cmd += ["--sections", "agent-turn", "--work-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=2 * TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables = _tables(proc.stdout)
    cold = [rows for t, rows in tables.items() if t.startswith("Cold prefill of a")]
    assert len(cold) == 1, proc.stdout
    seen = {(r["residency"], r["prefill"]) for r in cold[0]}
    assert seen == {
        (residency, prefill)
        for residency in ("100%", "0% (streamed)")
        for prefill in ("all cores", "one thread (before)")
    }
    for row in cold[0]:
        assert _number(row["tok/s"]) > 0 and _number(row["cores busy"]) > 0, row
        assert _number(row["CPU spread"]) >= 1.0, row
    targets = proc.stdout.split("Agent-turn targets")[1]
    assert re.search(r"^  cold prefill, all cores / one thread: [0-9.]+x$", targets, re.M)
    assert re.search(r"^  cores busy: [0-9.]+ \(target >= 1.8\) (met|MISSED)$", targets, re.M)
    assert re.search(r"^  CPU spread \(CPU time / [^)]*\): [0-9.]+$", targets, re.M)
    assert re.search(r"^  cold prefill / llama-server: not measured: no llama", targets, re.M)
    agent = [rows for t, rows in tables.items() if t.startswith("Agent turn:")]
    assert len(agent) == 1 and len(agent[0]) == 1, proc.stdout
    row = agent[0][0]
    assert int(row["reused"]) >= 600  # the cached conversation was found
    bound = 1.3 * (_number(row["cold 40 s"]) + _number(row["attention 40 x 640 s"]))
    assert abs(_number(row["bound s"]) - bound) < 0.02
    assert re.search(r"agent turn TTFT [0-9.]+ s, bound 1.3 x \(", targets)
    # The dense Q4_0 model's rows (bench/prefill.py run_dense_turn): both paths, both prompts.
    dense = [rows for t, rows in tables.items() if t.startswith("Cold prefill, dense qwen3")]
    assert len(dense) == 1, proc.stdout
    assert {(r["prefill"], r["prompt tokens"]) for r in dense[0]} == {
        (p, n) for p in ("int16", "float (before)") for n in ("160", "24")
    }
    assert all(_number(r["tok/s"]) > 0 for r in dense[0])
    dense_targets = proc.stdout.split("1.2B dense targets")[1]
    assert re.search(r"^  160 tokens, int16 / float: [0-9.]+x$", dense_targets, re.M)
    assert re.search(r"^  24 tokens / llama-server: not measured", dense_targets, re.M)
    # Both models served over HTTP (bench/agent_turn/over_http.py): the four turn measures,
    # flashserve's numbers, llama-server's column empty without a binary and said so.
    turns = {t: rows for t, rows in tables.items() if t.startswith("Turns over HTTP, ")}
    assert [t.split(",")[1].split(":")[0].strip() for t in turns] == [
        "default",
        "dense Q4_0 (quick shape)",
    ]
    for rows in turns.values():
        assert [r["measure"] for r in rows] == [
            "prefill tok/s",
            "TTFT ms",
            "next-turn TTFT ms",
            "decode tok/s",
        ]
        assert all(_number(r["flashserve"]) > 0 and r["llama-server"] == "-" for r in rows), rows
        assert all(_number(r["flashserve int8"]) > 0 for r in rows), rows  # int8 prompt rows
        assert int(rows[0]["what"].split("-")[0]) >= 160  # the cold prompt's tokens, counted
        assert int(rows[2]["what"].split()[0]) >= 100  # the conversation was reused
    for part in proc.stdout.split("Turns over HTTP, ")[1:]:
        assert "\n  llama-server: not measured (no binary" in part
    assert "llama.cpp's deviation from the float path: not measured (no llama-server)" in (
        proc.stdout
    )


def test_quick_speculative_section_prints_its_rows(tmp_path: Path) -> None:
    """The speculative section: the rows of issues 44 and 55, tokens/s off and on,
    bytes read per token, acceptance, and greedy identity (always "yes")."""
    cmd = [sys.executable, "-m", "flashserve.server.cli", "bench", "--", "--quick"]
    cmd += ["--sections", "speculative", "--work-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=2 * TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables = _tables(proc.stdout)
    spec = [rows for t, rows in tables.items() if t.startswith("Speculative decoding")]
    assert len(spec) == 1, proc.stdout
    assert [r["row"] for r in spec[0]] == [
        "edit-0%",
        "edit-100%",
        "rejected-0%",
        "prose-100%",
        "4-streams-100%",
        "moe-25%",
    ]
    for row in spec[0]:
        assert _number(row["off tok/s"]) > 0 and _number(row["on tok/s"]) > 0, row
        assert row["same tokens"] == "yes", row
    streamed = spec[0][0]
    # At 0% residency every token reads the layers: speculation reads less per token.
    assert _number(streamed["MB/token on"]) < _number(streamed["MB/token off"]), streamed


def test_quick_models_section_prints_loads_and_the_contention_ratio(tmp_path: Path) -> None:
    """The models section: one server, two models loaded on their first requests (load
    time, memory, TTFT with the load), and the small model's TTFT while the big one
    decodes against alone, with its target."""
    cmd = [sys.executable, "-m", "flashserve.server.cli", "bench", "--", "--quick"]
    cmd += ["--sections", "models", "--work-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=2 * TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    tables = _tables(proc.stdout)
    loads = [rows for t, rows in tables.items() if t.startswith("Models: load on first")]
    assert len(loads) == 1 and {r["model"] for r in loads[0]} == {"big", "small"}, proc.stdout
    for row in loads[0]:
        assert _number(row["size MB"]) > 0 and _number(row["memory MB"]) > 0, row
        first, load = _number(row["first TTFT s (load included)"]), _number(row["load s"])
        assert 0 < load < first, row  # the first request waited for its model's load
    beside = [rows for t, rows in tables.items() if t.startswith("Models: the small model's")]
    (row,) = beside[0]
    alone, during = (
        _number(row["small TTFT alone s"]),
        _number(row["small TTFT while big decodes s"]),
    )
    # The cells are rounded to 0.01 s: the ratio agrees within what that rounding allows.
    slack = 0.005 * (1 + during / alone) / alone + 0.005
    assert abs(_number(row["ratio"]) - during / alone) <= slack, row
    assert row["met"] == ("yes" if _number(row["ratio"]) <= 1.5 else "no"), row


def test_quick_images_section_prints_the_encode_and_both_ttfts(tmp_path: Path) -> None:
    """The images section: one image's encode time, and the TTFT of a prompt with it
    cold and as the next turn, which the prompt cache serves without the tower."""
    pytest.importorskip("mlx_vlm", reason="the vision extra")
    cmd = [sys.executable, "-m", "flashserve.server.cli", "bench", "--", "--quick"]
    cmd += ["--sections", "images", "--work-dir", str(tmp_path)]
    proc = subprocess.run(
        cmd, cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (rows,) = [rows for t, rows in _tables(proc.stdout).items() if t.startswith("Images:")]
    cold, first, following = rows
    assert [r["turn"] for r in rows] == ["cold", "first turn", "next turn"]
    # The quick model answers in milliseconds: its times print as 0.00 or 0.01 (2 decimals).
    assert _number(cold["cached tokens"]) == 0 and _number(cold["TTFT s"]) >= 0
    # The next turn resends the first (its image in it): the prompt cache holds it.
    assert _number(following["cached tokens"]) >= _number(first["prompt tokens"])
