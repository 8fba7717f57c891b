"""GET /cache/stats on a real server: a prepared tiny MoE model behind an expert cache.

The server is `flashserve serve` in a subprocess on loopback, driven with httpx
and the official openai SDK.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from flashserve.engine.weights.layout import read_manifest
from flashserve.engine.weights.prepare import prepare

from .conftest import NO_EOS, Server, start_server, stop_server

SLOTS = 4


@pytest.fixture(scope="module")
def prepared_moe(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(
        str(tiny_moe_dir), tmp_path_factory.mktemp("cache-api") / "prepared", expert_bits=4
    )


@pytest.fixture(scope="module")
def moe_server(prepared_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("moe-server")
    server = start_server(
        prepared_moe,
        workdir,
        "--expert-cache",
        str(SLOTS),
        "--expert-prefetch",
        "next-layer",
        "--expert-policy",
        "lfu",
        "--record-routing",
        str(workdir / "routing.jsonl"),
    )
    server.workdir = workdir  # type: ignore[attr-defined]
    yield server
    stop_server(server)


def chat(server: Server, tokens: int = 8, **kwargs) -> object:
    return server.client().chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": "Hello, how are you?"}],
        max_tokens=tokens,
        temperature=0,
        logit_bias=NO_EOS,
        **kwargs,
    )


def test_cache_stats_schema_and_counters(moe_server: Server) -> None:
    http = moe_server.http()
    chat(moe_server)
    body = http.get("/cache/stats").json()
    assert body["enabled"] is True
    assert body["policy"] == "lfu" and body["prefetch"] == "next-layer"
    assert body["capacity_slots"] == SLOTS and body["capacity_bytes"] is None
    assert 0 < body["occupancy_slots"] <= SLOTS
    assert body["moe_layers"] == [0, 1, 2, 3]
    start = body["since_start"]
    assert start["tokens"] > 8 and start["forwards"] >= 8
    assert start["hits"] + start["prefetch_hits"] + start["misses"] > 0
    assert start["misses"] > 0 and start["bytes_read"] > 0
    assert 0.0 <= start["hit_rate"] <= 1.0 and 0.0 <= start["io_wait_share"] <= 1.0
    assert 0.0 <= start["prefetch_precision"] <= 1.0
    layers = start["layers"]
    assert [layer["layer"] for layer in layers] == [0, 1, 2, 3]
    assert sum(layer["misses"] for layer in layers) == start["misses"]
    assert sum(layer["resident_experts"] for layer in layers) == body["occupancy_slots"]
    # The same numbers under the OpenAI-style prefix.
    assert http.get("/v1/cache/stats").json()["capacity_slots"] == SLOTS

    # Resetting the window leaves the totals alone.
    reset = http.post("/cache/stats/reset").json()
    assert reset["window"]["misses"] == 0 and reset["window"]["tokens"] == 0
    assert reset["since_start"]["misses"] == start["misses"]
    chat(moe_server, tokens=4)
    after = http.get("/cache/stats", params={"layers": "false"}).json()
    assert after["since_start"]["layers"] is None
    assert 0 < after["window"]["tokens"] < after["since_start"]["tokens"]
    assert after["since_start"]["misses"] >= start["misses"]


def test_last_step_shows_expert_loads_shared_by_the_batch(
    moe_server: Server, tiny_moe_dir: Path
) -> None:
    config = json.loads((tiny_moe_dir / "config.json").read_text())
    top_k, layers = config["num_experts_per_tok"], 4
    http = moe_server.http()
    chat(moe_server, tokens=6)
    alone = http.get("/cache/stats", params={"layers": "false"}).json()
    step = alone["last_step"]
    # One token: each needed expert serves one routing.
    assert step["tokens"] == 1 and alone["batch_size"] == 1
    assert step["expert_uses"] == top_k * layers == step["experts_needed"]
    assert step["uses_per_needed_expert"] == 1.0
    assert 0 <= step["expert_reads"] <= step["experts_needed"]

    threads = [threading.Thread(target=chat, args=(moe_server, 48)) for _ in range(3)]
    for thread in threads:
        thread.start()
    shared = []
    while any(thread.is_alive() for thread in threads):
        step = http.get("/cache/stats", params={"layers": "false"}).json()["last_step"]
        assert step["expert_uses"] == step["tokens"] * top_k * layers
        assert step["experts_needed"] <= step["expert_uses"]
        if step["tokens"] == 3:
            shared.append(step)
        time.sleep(0.005)
    for thread in threads:
        thread.join()
    # A decode step of three sequences looks each needed expert up once.
    assert shared, "no poll saw a step of the whole batch"
    assert all(
        s["experts_needed"] <= min(3 * top_k, config["num_experts"]) * layers for s in shared
    )
    assert max(s["uses_per_needed_expert"] for s in shared) > 1.0


def test_routing_trace_is_written(moe_server: Server) -> None:
    chat(moe_server, tokens=4)
    trace = moe_server.workdir / "routing.jsonl"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while not trace.exists() or not trace.read_text().strip():
        assert time.monotonic() < deadline, "no routing trace written"
        time.sleep(0.1)
    lines = [json.loads(text) for text in trace.read_text().splitlines()]
    # The prompt's lines come first and say so: a prefill call never evicts.
    assert set(lines[0]) == {"fwd", "token", "layer", "experts", "prefill"}
    assert lines[0]["prefill"] is True
    assert len(lines[0]["experts"]) == 2
    decoded = [line for line in lines if "prefill" not in line]
    assert decoded and set(decoded[0]) == {"fwd", "token", "layer", "experts"}


def test_polling_does_not_wait_for_generation(moe_server: Server) -> None:
    done = threading.Event()

    def long_generation() -> None:
        try:
            chat(moe_server, tokens=400)
        finally:
            done.set()

    worker = threading.Thread(target=long_generation)
    worker.start()
    http = moe_server.http()
    try:
        time.sleep(0.2)
        polls = []
        while not done.is_set() and len(polls) < 20:
            start = time.perf_counter()
            assert http.get("/cache/stats").status_code == 200
            polls.append(time.perf_counter() - start)
        assert polls, "generation finished before the first poll"
        assert max(polls) < 1.0, polls
    finally:
        worker.join(timeout=120)


def test_model_without_expert_cache_says_disabled(llama_server: Server) -> None:
    body = llama_server.http().get("/cache/stats").json()
    assert body == {**body, "enabled": False, "since_start": None}


def test_corrupted_expert_fails_one_request_and_the_server_goes_on(
    prepared_moe: Path, tmp_path: Path
) -> None:
    path = tmp_path / "prepared"
    shutil.copytree(prepared_moe, path)
    server = start_server(path, tmp_path, "--expert-cache", "2")
    try:
        first = chat(server)
        experts = read_manifest(path)["layers"][2]["experts"]
        file = path / experts["file"]
        original = file.read_bytes()
        data = bytearray(original)
        for offset, length in experts["switches"][0]["records"]:
            data[offset + length // 2] ^= 0xFF
        file.write_bytes(bytes(data))
        with pytest.raises(openai.APIStatusError) as info:
            chat(server)
        message = str(info.value)
        assert "of layer 2" in message and "expert" in message and "checksum" in message
        file.write_bytes(original)
        again = chat(server)
        assert again.choices[0].message.content == first.choices[0].message.content
    finally:
        stop_server(server)
