"""Several models in one server (engine/models/): by name, loaded on demand, unloaded
when idle or to make room, each on its own worker; real servers, real model files.

Models: tiny random llama and qwen3 directories, the bundled SmolLM2 GGUF and the
Gemma 3 Q4_K_M GGUF; larger float32 ones where memory is measured.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.models.catalog import CatalogError, build
from flashserve.engine.weights.sources import default_model_path
from flashserve.engine.weights.synthetic import make_model_dir
from tests.conftest import NO_EOS, Server, metric, start_server, stop_server
from tests.test_gguf_gemma import gemma_path  # noqa: F401  (a fixture)
from tests.test_memory_limits import _make_group, _remove_group, _start_in_group

# ~200 MB float32 each: a model's memory stands well above the runtime's noise.
MID = {
    "hidden_size": 768,
    "num_hidden_layers": 10,
    "intermediate_size": 1536,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models-dir")
    make_model_dir(root / "tiny-llama", "llama", seed=1)
    make_model_dir(root / "tiny-qwen3", "qwen3", seed=2)
    (root / "SmolLM2.gguf").symlink_to(default_model_path())
    (root / "broken.gguf").write_bytes(b"GGUF" + os.urandom(4096))  # a damaged file
    (root / "notes.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def mid_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mid-models")
    make_model_dir(root / "mid-llama", "llama", overrides=MID, seed=3)
    make_model_dir(root / "mid-qwen3", "qwen3", overrides=MID, seed=4)
    return root


GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}


def _complete(http: httpx.Client, model: str, tokens: int = 24, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens}
    body |= {"temperature": 0, "logit_bias": NO_EOS, **extra}
    return http.post("/v1/completions", json=body)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _stream_lines(http: httpx.Client, path: str, model: str) -> list[str]:
    """The SSE lines of a streamed chat turn (OpenAI chat or Anthropic messages)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}]}
    body |= {"max_tokens": 8, "temperature": 0, "stream": True}
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line]


def _states(http: httpx.Client) -> dict[str, dict]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def _private(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_models_load_on_demand_and_serve_side_by_side(models_dir: Path, tmp_path: Path) -> None:
    server = start_server(
        None, tmp_path, "--models-dir", str(models_dir), "--stream-keepalive", "0.1"
    )
    try:
        http = server.http(timeout=300)
        cards = _states(http)
        assert set(cards) == {"tiny-llama", "tiny-qwen3", "SmolLM2", "broken"}
        assert all(c["state"] == "not loaded" and c["memory_bytes"] is None for c in cards.values())
        assert cards["SmolLM2"]["size_bytes"] == default_model_path().stat().st_size
        assert server.health().json()["status"] == "ok"

        # Each alone (the other not loaded): the reference.
        alone = {"tiny-llama": _text(_complete(http, "tiny-llama", 48))}
        cards = _states(http)
        assert cards["tiny-llama"]["state"] == "loaded" and cards["tiny-llama"]["memory_bytes"]
        assert cards["tiny-qwen3"]["state"] == "not loaded"
        alone["tiny-qwen3"] = _text(_complete(http, "tiny-qwen3", 48))
        assert alone["tiny-llama"] != alone["tiny-qwen3"]

        # Both at once, twice each, on their own workers: the same tokens.
        results: dict[str, list[tuple[str, float, float]]] = {m: [] for m in alone}

        ready = threading.Barrier(4)  # all four sent together, not as each thread starts

        def run(model: str) -> None:
            client = server.http(timeout=300)
            ready.wait()
            start = time.monotonic()
            text = _text(_complete(client, model, 48))
            results[model].append((text, start, time.monotonic()))

        threads = [threading.Thread(target=run, args=(m,)) for m in alone for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for model, runs in results.items():
            assert [text for text, _, _ in runs] == [alone[model]] * 2, model
        windows = [(s, e) for runs in results.values() for _, s, e in runs]
        assert max(s for s, _ in windows) < min(e for _, e in windows)  # they overlapped

        # A damaged file: its requests get the reason, in each dialect; the others go on.
        bad = _complete(http, "broken")
        assert bad.status_code == 503, bad.text
        error = bad.json()["error"]
        assert error["code"] == "model_unavailable" and "broken" in error["message"]
        assert "failed to load" in error["message"]
        bad = http.post(
            "/v1/messages",
            json={
                "model": "broken",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert bad.status_code == 503 and bad.json()["type"] == "error", bad.text
        assert "failed to load" in bad.json()["error"]["message"]
        assert _states(http)["broken"]["state"] == "failed"
        assert _text(_complete(http, "tiny-llama", 48)) == alone["tiny-llama"]

        # Unknown names stay 404s, streamed or not.
        missing = _complete(http, "no-such-model")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert _complete(http, "no-such-model", stream=True).status_code == 404

        # A real GGUF with its chat template loads by name; a stream for it starts at
        # once and sends keepalive chunks (empty deltas) while it loads.
        before = time.monotonic()
        lines = _stream_lines(http, "/v1/chat/completions", "SmolLM2")
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        keepalives = [c for c in chunks if c["choices"] and c["choices"][0]["delta"] == {}]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        # The loading phase's keepalives come before the answer's own chunks (its id).
        loading = [c for c in keepalives if c["id"] != chunks[-1]["id"]]
        assert len(loading) >= 2 and text, chunks[:4]
        assert chunks[0] in loading and lines[-1] == "data: [DONE]"
        assert _states(http)["SmolLM2"]["load_seconds"] < time.monotonic() - before
        # Anthropic's dialect pings meanwhile; a model that fails to load ends the
        # stream with its error event (the status went out as 200).
        lines = _stream_lines(http, "/v1/messages", "broken")
        events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        assert events[-1] == "error" and "failed to load" in lines[-1], lines[-4:]

        # /metrics: every loaded model's counters, labelled by model.
        metrics = http.get("/metrics").text
        for model in ("tiny-llama", "tiny-qwen3", "SmolLM2"):
            assert f'flashserve_engine_requests_total{{model="{model}"}}' in metrics
        memory = http.get("/memory", params={"model": "tiny-qwen3"}).json()
        assert {m["id"]: m["state"] for m in memory["models"]}["tiny-qwen3"] == "loaded"
    finally:
        stop_server(server)


def test_idle_model_is_unloaded_and_its_memory_goes_back(mid_models: Path, tmp_path: Path) -> None:
    server = start_server(None, tmp_path, "--models-dir", str(mid_models), "--idle-unload", "2")
    try:
        assert server.process is not None
        pid, http = server.process.pid, server.http(timeout=300)
        before = _private(pid)
        first = _text(_complete(http, "mid-llama", 8))
        card = _states(http)["mid-llama"]
        assert card["state"] == "loaded"
        resident = _private(pid) - before
        assert resident > 150e6, resident  # ~200 MB of float32 weights
        deadline = time.monotonic() + 30
        while _states(http)["mid-llama"]["state"] == "loaded":
            assert time.monotonic() < deadline, "not unloaded after 30 s idle"
            time.sleep(0.5)
        freed = before + resident - _private(pid)
        assert freed >= 0.5 * resident, (freed, resident)
        metrics = http.get("/metrics").text
        assert "flashserve_models_unloads_total 1.0" in metrics
        # It loads again on the next request, with the same tokens.
        assert _text(_complete(http, "mid-llama", 8)) == first
    finally:
        stop_server(server)


def test_a_cgroup_that_holds_one_model_swaps_them(mid_models: Path, tmp_path: Path) -> None:
    limit = 460 * 1024 * 1024  # the server (~90 MB private) and one ~210 MB model, not two
    group = _make_group(limit)
    server: Server | None = None
    try:
        server = _start_in_group(group, None, tmp_path, "--models-dir", str(mid_models))
        http = server.http(timeout=300)
        texts: dict[str, list[str]] = {"mid-llama": [], "mid-qwen3": []}
        for model in ["mid-llama", "mid-qwen3"] * 2:
            texts[model].append(_text(_complete(http, model, 8)))
            loaded = [n for n, c in _states(http).items() if c["state"] == "loaded"]
            assert loaded == [model], loaded
        assert all(len(set(t)) == 1 for t in texts.values()), texts
        # While the loaded model serves a request, the other cannot have its room: a 503
        # to retry (loading it anyway would have the group OOM-kill the server).
        decoding, done = threading.Event(), threading.Event()

        def decode() -> None:
            body = {"model": "mid-qwen3", "prompt": "Once upon a time", "max_tokens": 200}
            body |= {"temperature": 0, "logit_bias": NO_EOS, "stream": True}
            with server.http(timeout=300).stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    decoding.set()
            done.set()

        threading.Thread(target=decode, daemon=True).start()
        assert decoding.wait(60)
        busy = _complete(http, "mid-llama", 8)
        assert not done.is_set(), "the decode ended before the other model was asked for"
        assert busy.status_code == 503 and busy.headers.get("retry-after"), busy.text
        assert "mid-qwen3" in busy.json()["error"]["message"]
        assert done.wait(120)
        assert _text(_complete(http, "mid-llama", 8)) == texts["mid-llama"][0]
        assert server.process is not None and server.process.poll() is None
        oom = (group / "memory.oom_control").read_text()
        assert "oom_kill 0" in oom or "oom_kill" not in oom, oom
        assert "unloaded (room for" in server.log_tail(20000)
    finally:
        if server is not None:
            stop_server(server)
        _remove_group(group)


def test_aliases_and_model_tables(
    models_dir: Path,
    gemma_path: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f"""
[models.small]
path = "{default_model_path()}"
aliases = ["claude-haiku-4-5", "claude-3-5-haiku-latest"]
pinned = true

[models.gemma]
path = "{gemma_path}"
aliases = ["gemma"]
context = 512
"""
    )
    server = start_server(
        models_dir / "tiny-llama", tmp_path, "--config", str(config), "--models-max", "2"
    )
    try:
        http = server.http(timeout=300)
        cards = _states(http)
        assert cards["tiny-llama"]["state"] == "loaded"  # --model: loaded at start
        assert cards["small"]["aliases"] == ["claude-haiku-4-5", "claude-3-5-haiku-latest"]
        sdk = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0)
        ask = [{"role": "user", "content": "Write a title for this chat."}]
        by_alias = sdk.messages.create(model="claude-haiku-4-5", max_tokens=8, messages=ask)
        by_id = sdk.messages.create(model="small", max_tokens=8, messages=ask, **GREEDY)
        by_alias_greedy = sdk.messages.create(
            model="claude-3-5-haiku-latest", max_tokens=8, messages=ask, **GREEDY
        )
        assert by_alias.model == by_id.model == "small"
        assert by_alias_greedy.content[0].text == by_id.content[0].text
        # The main model still answers under its own name (and the --model's path).
        main = sdk.messages.create(model="tiny-llama", max_tokens=4, messages=ask)
        assert main.model == "tiny-llama"

        # A third model with models_max 2: the least recently used idle one that is
        # not pinned goes (tiny-llama is the --model: pinned too), so none can: 503.
        crowded = _complete(http, "gemma", 4)
        assert crowded.status_code == 503, crowded.text
        assert "models_max" in crowded.json()["error"]["message"]
        assert crowded.headers.get("retry-after")
    finally:
        stop_server(server)

    # Without the pins, the Gemma GGUF replaces the least recently used model, and
    # its table's context caps it.
    config.write_text(config.read_text().replace("pinned = true\n", ""))
    server = start_server(None, tmp_path, "--config", str(config), "--models-max", "1")
    try:
        http = server.http(timeout=300)
        assert _text(_complete(http, "claude-haiku-4-5", 4))
        gemma = _complete(http, "gemma", 4)
        assert _text(gemma)
        cards = _states(http)
        assert cards["gemma"]["state"] == "loaded" and cards["small"]["state"] == "not loaded"
        assert cards["gemma"]["context_length"] == 512
        too_long = _complete(http, "gemma", 4, prompt=[10] * 600)
        assert too_long.status_code == 400, too_long.text
        health = server.health().json()
        assert {m["id"] for m in health["models"]} == {"small", "gemma"}
        assert json.loads(json.dumps(health))["status"] == "ok"
    finally:
        stop_server(server)


def test_catalog_names_tables_and_their_checks(models_dir: Path, tmp_path: Path) -> None:
    base = EngineConfig()
    tables = {
        "tiny-llama": {"aliases": ["main"], "speculative": "draft"},
        "tiny-llama-copy": {"path": str(models_dir / "tiny-llama"), "context": 256},
    }
    tables["tiny-llama"]["speculative_draft_model"] = "SmolLM2"  # another model, by id
    entries, default = build(base, None, None, str(models_dir), tables)
    by_name = {e.name: e for e in entries}
    assert default is None  # models_dir alone: nothing loads at start
    assert set(by_name) == {"tiny-llama", "tiny-qwen3", "SmolLM2", "broken", "tiny-llama-copy"}
    assert by_name["tiny-llama"].names == {"tiny-llama", "main"}
    assert by_name["tiny-llama"].config.speculative == "draft"
    assert by_name["tiny-llama"].config.speculative_draft_model == str(models_dir / "SmolLM2.gguf")
    assert by_name["tiny-llama-copy"].config.context_length == 256
    assert by_name["tiny-qwen3"].config.speculative == "off"  # the server's settings
    with pytest.raises(CatalogError, match="device"):
        build(base, None, None, str(models_dir), {"tiny-qwen3": {"device": "gpu"}})
    with pytest.raises(CatalogError, match="'tiny-llama' is both"):
        build(base, None, None, str(models_dir), {"tiny-qwen3": {"aliases": ["tiny-llama"]}})
    with pytest.raises(CatalogError, match="no path"):
        build(base, None, None, str(models_dir), {"elsewhere": {"pinned": True}})
    # --model alone: one entry, pinned, the spec's own names, the config unchanged.
    spec = str(models_dir / "tiny-qwen3")
    (only,), default = build(EngineConfig(model=spec), spec, None, None, {})
    assert default == only.name == "tiny-qwen3" and only.pinned
    assert only.config.model == spec and spec in only.names


def test_a_prefill_goes_before_another_models_decode(mid_models: Path, tmp_path: Path) -> None:
    """While one model decodes, another's prompt prefills first (its decode steps wait,
    briefly: generation/fairness.py); neither model's tokens change."""
    server = start_server(None, tmp_path, "--models-dir", str(mid_models))
    try:
        http = server.http(timeout=300)
        long_alone = _text(_complete(http, "mid-llama", 96))
        prompt = "A prompt long enough to take a while to prefill. " * 12
        short_alone = _text(_complete(http, "mid-qwen3", 4, prompt=prompt))
        waited = metric(http.get("/metrics").text, "flashserve_models_decode_wait_seconds_total")
        assert waited == 0.0  # one model at a time: nobody waited

        long: list[str] = []
        decoding = threading.Event()

        def decode() -> None:
            body = {"model": "mid-llama", "prompt": "Once upon a time", "max_tokens": 96}
            body |= {"temperature": 0, "logit_bias": NO_EOS, "stream": True}
            with server.http(timeout=300).stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        long.append(json.loads(line[6:])["choices"][0]["text"])
                        decoding.set()

        thread = threading.Thread(target=decode)
        thread.start()
        assert decoding.wait(120)
        shorts = [_text(_complete(http, "mid-qwen3", 4, prompt=prompt)) for _ in range(2)]
        thread.join()
        assert "".join(long) == long_alone and shorts == [short_alone] * 2
        waited = metric(http.get("/metrics").text, "flashserve_models_decode_wait_seconds_total")
        assert waited is not None and waited > 0
    finally:
        stop_server(server)
