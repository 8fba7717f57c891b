"""Prompt cache, SSD tier: states survive eviction and restarts, and bad files are never served.

Every engine here starts with an empty memory tier, so a hit after a restart
can only come from the files. Greedy output with a disk hit must be
token-identical to a cold run of the fully resident model (reference BLAS).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flashserve.engine.prompt_cache import files as prompt_files
from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir

from .conftest import metric, start_server, stop_server
from .test_prompt_cache import BASE, DIVERGED, GROWN, _engine, _in_turn, _together, common


def _disk_engine(model: Path, directory: Path, **config):
    config.setdefault("prompt_cache_bytes", 1 << 30)
    config.setdefault("prompt_cache_disk_bytes", 1 << 30)
    return _engine(model, prompt_cache_dir=str(directory), **config)


def _run_and_stop(engine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    try:
        return _in_turn(engine, prompts)
    finally:
        engine.shutdown()  # waits for the pending writes


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{prompt_files.SUFFIX}"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_next"])
def test_disk_hits_after_a_restart_match_cold_runs(
    cache_arch_dirs: dict[str, Path], tmp_path: Path, arch: str
):
    expected = _run_and_stop(_engine(cache_arch_dirs[arch]), [GROWN, DIVERGED])
    _run_and_stop(_disk_engine(cache_arch_dirs[arch], tmp_path), [BASE])
    restarted = _disk_engine(cache_arch_dirs[arch], tmp_path)
    got = _run_and_stop(restarted, [GROWN, DIVERGED])
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    trims = arch != "qwen3_next"  # recurrent state is reused whole or not at all
    assert [cached for _, cached in got] == [
        len(BASE) if trims else len(BASE) - 1,
        20 if trims else 0,
    ]
    disk = restarted.prompt_cache.snapshot()["disk"]
    assert disk["hits"] == 1 and disk["bytes_read"] > 0 and disk["discarded"] == 0


@pytest.mark.parametrize(
    ("arch", "knobs"),
    [
        ("llama", {"resident_layers": 0}),
        ("qwen3_moe", {"resident_layers": 0, "expert_cache": "6"}),
        ("qwen3_next", {"resident_layers": 0}),
    ],
)
def test_streamed_disk_hits_in_a_batch_match_resident_cold_runs(
    cache_arch_dirs: dict[str, Path], tmp_path: Path, arch: str, knobs: dict
):
    prepared = prepare(str(cache_arch_dirs[arch]), tmp_path / "prepared", expert_bits=4)
    prompts = [GROWN, DIVERGED, [*BASE, 3]]
    expected = _run_and_stop(_engine(prepared), [BASE, *prompts])  # all resident, solo
    _run_and_stop(_disk_engine(prepared, tmp_path / "cache", **knobs), [BASE])
    restarted = _disk_engine(prepared, tmp_path / "cache", max_batch=4, **knobs)
    try:
        got = _together(restarted, prompts)
    finally:
        restarted.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected[1:]]
    answered = BASE + expected[0][0]
    if arch == "qwen3_next":  # only a whole entry that prefixes the prompt serves
        assert [cached for _, cached in got] == [len(BASE) - 1, 0, len(BASE) - 1]
    else:
        assert [cached for _, cached in got] == [common(p, answered) for p in prompts]


def test_corrupt_and_truncated_entries_are_discarded_never_served(
    cache_arch_dirs: dict[str, Path], tmp_path: Path
):
    model = cache_arch_dirs["llama"]
    other = [9, *BASE[1:]]
    expected = _run_and_stop(_engine(model), [[*BASE, 3], [*other, 3]])
    writer = _disk_engine(model, tmp_path)
    _run_and_stop(writer, [BASE, other])
    fingerprint = writer.prompt_cache.disk.model
    # Each prompt's root file; its answer's state continues it (a second file
    # holding only the answer), so damaging the root must take both out.
    headers = {p: prompt_files.read_header(p, fingerprint) for p in _entries(tmp_path)}
    files = {tuple(h.tokens[:2]): p for p, h in headers.items() if h.start == 0}
    assert len(files) == 2 and len(headers) == 4
    corrupt, truncated = files[tuple(BASE[:2])], files[tuple(other[:2])]
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit pattern deep in the payload: same size
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-64])
    garbage = tmp_path / f"{fingerprint[:16]}-garbage{prompt_files.SUFFIX}"
    garbage.write_bytes(b"not a cache entry at all")

    reader = _disk_engine(model, tmp_path)
    got = _run_and_stop(reader, [[*BASE, 3], [*other, 3]])
    assert got == [(tokens, 0) for tokens, _ in expected]  # prefilled, right answer
    disk = reader.prompt_cache.snapshot()["disk"]
    assert disk["discarded"] == 3 and disk["hits"] == 0
    assert not corrupt.exists() and not truncated.exists() and not garbage.exists()
    assert disk["evicted"] == 2  # the answers' files continued them: deleted with them


def test_entries_of_other_weights_or_format_are_never_used(tmp_path: Path):
    # Same architecture, same served name, other weights.
    first = make_model_dir(tmp_path / "a", "llama", seed=1)
    second = make_model_dir(tmp_path / "b", "llama", seed=2)
    cache = tmp_path / "cache"
    expected = _run_and_stop(_engine(second, model_id="same"), [[*BASE, 3]])
    _run_and_stop(_disk_engine(first, cache, model_id="same"), [BASE])
    foreign = _entries(cache)  # the prompt's file, and its answer's continuing it
    assert len(foreign) == 2

    other = _disk_engine(second, cache, model_id="same")
    got = _run_and_stop(other, [[*BASE, 3]])
    assert got == [(expected[0][0], 0)]
    # Another model's entries stay, counted in the directory.
    assert all(path.exists() for path in foreign)
    disk = other.prompt_cache.snapshot()["disk"]
    assert disk["dir_bytes"] > disk["bytes"] and disk["discarded"] == 0

    # Entries of another cache format version are left alone and never read.
    for path in foreign:
        data = bytearray(path.read_bytes())
        data[8:12] = (prompt_files.FORMAT_VERSION + 1).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    again = _disk_engine(first, cache, model_id="same")
    assert _run_and_stop(again, [[*BASE, 3]])[0][1] == 0
    assert all(path.exists() for path in foreign)
    assert again.prompt_cache.snapshot()["disk"]["discarded"] == 0


def test_a_full_disk_budget_evicts_the_oldest_entries(
    cache_arch_dirs: dict[str, Path], tmp_path: Path
):
    model = cache_arch_dirs["llama"]
    probe = tmp_path / "probe"
    _run_and_stop(_disk_engine(model, probe), [BASE])
    # One answered prompt: its prompt's file and its answer's, continuing it.
    budget = int(sum(p.stat().st_size for p in _entries(probe)) * 2.5)
    prompts = [[first, *BASE[1:]] for first in (1, 2, 3, 4)]

    cache = tmp_path / "cache"
    filler = _disk_engine(model, cache, prompt_cache_disk_bytes=budget)
    _run_and_stop(filler, prompts)
    disk = filler.prompt_cache.snapshot()["disk"]
    assert disk["dir_bytes"] <= budget and disk["evicted"] >= 2
    assert sum(p.stat().st_size for p in _entries(cache)) == disk["dir_bytes"]

    reader = _disk_engine(model, cache)  # a roomy budget: its own writes evict nothing
    got = _run_and_stop(reader, [[*p, 3] for p in prompts])
    # The two newest answered prompts are still there whole; the oldest went
    # first (a conversation's last file before the one it continues).
    cached = [cached for _, cached in got]
    assert cached[0] == 0 and cached[1] in (0, len(BASE) - 1)
    assert cached[2:] == [len(BASE), len(BASE)]


def test_server_serves_a_disk_hit_after_restart(tiny_llama_dir: Path, tmp_path: Path):
    args = ("--prompt-cache-bytes", "64MB", "--prompt-cache-dir", str(tmp_path / "cache"))
    body = {"max_tokens": 3, "temperature": 0}
    server = start_server(tiny_llama_dir, tmp_path, *args)
    try:
        first = server.http().post("/v1/completions", json={"prompt": BASE, **body})
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        stop_server(server)
    server = start_server(tiny_llama_dir, tmp_path, *args)
    try:
        http = server.http()
        again = http.post("/v1/completions", json={"prompt": GROWN, **body})
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(BASE)
        stats = http.get("/cache/stats").json()["prompt_cache"]
        assert stats["disk"]["hits"] == 1 and stats["disk"]["bytes_read"] > 0
        assert stats["disk"]["dir"] == str(tmp_path / "cache")
        assert stats["memory"]["misses"] == 1 and stats["hits"] == 1
        metrics = http.get("/metrics").text
        assert metric(metrics, "flashserve_prompt_cache_disk_hits_total") == 1.0
    finally:
        stop_server(server)
