"""The server when things go wrong: loading, a generation that fails, a full queue,
a model that does not load.

These tests need control over the engine, so the app is built in this process
(server.app.create_app with a real Engine on a tiny real model) and served by
uvicorn on loopback. The engine here is real; the test subclass only holds its
start until the test allows it, and plants a logits processor that raises in
requests with a marker seed, the way a bug inside generation would.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest

from flashserve.engine.generation.requests import GenerationRequest, RequestHandle
from flashserve.engine.generation.worker import Engine
from flashserve.server.app import create_app
from flashserve.server.settings import load_settings

from .conftest import NO_EOS, Server, serve_app

FAIL_SEED = 666  # requests with this seed fail after a few tokens
SLOW_SEED = 777  # requests with this seed take 20 ms a token
TOKENS_BEFORE_FAILURE = 3
CHAT = "/v1/chat/completions"


def _fails_after(steps: int) -> Any:
    calls = 0

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal calls
        calls += 1
        if calls > steps:
            raise RuntimeError("injected failure in generation")
        return logits

    return processor


def _slow(tokens: mx.array, logits: mx.array) -> mx.array:
    time.sleep(0.02)
    return logits


class ControlledEngine(Engine):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def start(self) -> None:
        # Hold the model load back until the test opens the gate.
        def later() -> None:
            self.gate.wait()
            Engine.start(self)

        threading.Thread(target=later, daemon=True).start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if request.sampling.seed == FAIL_SEED:
            request.logits_processors.append(_fails_after(TOKENS_BEFORE_FAILURE))
        if request.sampling.seed == SLOW_SEED:
            request.logits_processors.append(_slow)
        return super().submit(request)


@pytest.fixture(scope="module")
def controlled(tiny_llama_dir: Path) -> Iterator[tuple[Server, ControlledEngine]]:
    # One request at a time and one waiting: the third gets 429.
    settings = load_settings(model=str(tiny_llama_dir), max_batch=1, max_queue=1)
    engine = ControlledEngine(settings.engine_config())
    with serve_app(create_app(settings, engine)) as server:
        try:
            yield server, engine
        finally:
            engine.gate.set()
            engine.wait_ready(30)


def _body(**kwargs: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, **kwargs}


def _assert_error(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    return error


def test_503_while_loading_then_200(controlled: tuple[Server, ControlledEngine]) -> None:
    server, engine = controlled
    http = server.http()
    health = http.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "loading"
    assert health.json()["error"]["code"] == "model_not_ready"
    for response in (http.post(CHAT, json=_body()), http.get("/v1/models")):
        error = _assert_error(response, 503, "server_error")
        assert error["code"] == "model_not_ready"
        assert response.headers["retry-after"]

    engine.gate.set()
    assert engine.wait_ready(60)
    assert http.get("/health").status_code == 200
    assert http.post(CHAT, json=_body()).status_code == 200


def test_a_failing_generation_is_a_500_for_that_client_only(
    controlled: tuple[Server, ControlledEngine],
) -> None:
    server, engine = controlled
    engine.gate.set()
    assert engine.wait_ready(60)
    http = server.http()
    response = http.post(CHAT, json=_body(seed=FAIL_SEED, logit_bias=NO_EOS))
    error = _assert_error(response, 500, "server_error")
    assert "injected failure" in error["message"]
    assert "Traceback" not in error["message"]
    # The worker keeps serving.
    ok = http.post(CHAT, json=_body(temperature=0, logit_bias=NO_EOS))
    assert ok.status_code == 200
    assert ok.json()["usage"]["completion_tokens"] == 8


def test_a_failing_stream_ends_with_an_error_event_and_done(
    controlled: tuple[Server, ControlledEngine],
) -> None:
    server, engine = controlled
    engine.gate.set()
    assert engine.wait_ready(60)
    response = server.http().post(
        CHAT, json=_body(seed=FAIL_SEED, stream=True, logit_bias=NO_EOS, max_tokens=50)
    )
    assert response.status_code == 200
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["type"] == "server_error" and "injected failure" in error["message"]
    # The SDK turns the error event into an exception.
    client = server.client()
    with pytest.raises(openai.APIError, match="injected failure"):
        for _ in client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Hello"}],
            seed=FAIL_SEED,
            max_tokens=50,
            logit_bias=NO_EOS,
            stream=True,
        ):
            pass
    ok = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logit_bias=NO_EOS,
    )
    assert ok.usage.completion_tokens == 4


def test_429_when_the_queue_is_full(controlled: tuple[Server, ControlledEngine]) -> None:
    server, engine = controlled
    engine.gate.set()
    assert engine.wait_ready(60)
    long = _body(max_tokens=1500, logit_bias=NO_EOS, stream=True)
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", CHAT, json=long) as running,
    ):
        lines = running.iter_lines()  # kept referenced: the stream stays open
        while not next(lines).startswith('data: {"id"'):
            pass
        with http.stream("POST", CHAT, json=long) as waiting:
            assert waiting.status_code == 200  # queued behind the first
            deadline = time.monotonic() + 10
            while server.health().json()["queued"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            response = httpx.post(server.url + CHAT, json=_body(), timeout=30)
            error = _assert_error(response, 429, "rate_limit_error")
            assert error["code"] == "queue_full"
            assert response.headers["retry-after"] == "1"
            with pytest.raises(openai.RateLimitError):
                server.client().chat.completions.create(
                    model="tiny-llama", messages=[{"role": "user", "content": "x"}]
                )
    # Both streams were closed: the worker is free again.
    assert not server.wait_idle(timeout=5)["busy"]


def test_a_request_cancelled_in_the_queue_frees_its_slot_at_once(
    controlled: tuple[Server, ControlledEngine],
) -> None:
    """One running, one waiting (max_batch 1 + max_queue 1): when the waiting client goes
    away, its slot is free before the worker reaches it, so a new request is accepted."""
    server, engine = controlled
    engine.gate.set()
    assert engine.wait_ready(60)
    long = _body(max_tokens=1500, logit_bias=NO_EOS, stream=True, seed=SLOW_SEED)
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", CHAT, json=long) as running,
    ):
        lines = running.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        with (
            httpx.Client(base_url=server.url, timeout=60) as other,
            other.stream("POST", CHAT, json=long) as waiting,
        ):
            assert waiting.status_code == 200
            assert server.health().json()["queued"] == 1
        # The waiting client hung up; the first stream still runs.
        deadline = time.monotonic() + 5
        while server.health().json()["queued"] > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.health().json()["queued"] == 0
        with (
            httpx.Client(base_url=server.url, timeout=60) as other,
            other.stream("POST", CHAT, json=long) as accepted,
        ):
            assert accepted.status_code == 200, accepted.read()
            assert server.health().json()["stats"]["active"] == 1  # the first still runs
    assert not server.wait_idle(timeout=10)["busy"]


@pytest.fixture(scope="module")
def wide(tiny_llama_dir: Path) -> Iterator[Server]:
    settings = load_settings(model=str(tiny_llama_dir), max_batch=4, max_queue=1)
    engine = Engine(settings.engine_config())
    with serve_app(create_app(settings, engine)) as server:
        assert engine.wait_ready(60)
        yield server


def test_a_burst_that_fits_batch_and_queue_is_admitted(wide: Server) -> None:
    """max_batch 4 + max_queue 1: five requests arriving together on an idle server are
    all accepted (the worker takes requests only between steps, so the queue alone would
    refuse some while batch slots are free); a sixth while they run gets 429."""
    slots = 5
    barrier = threading.Barrier(slots)
    body = _body(max_tokens=200, logit_bias=NO_EOS)

    def one() -> httpx.Response:
        with httpx.Client(base_url=wide.url, timeout=60) as http:
            barrier.wait()
            return http.post(CHAT, json=body)

    for _ in range(2):
        results: list[httpx.Response] = []

        def run(out: list[httpx.Response] = results) -> None:
            out.append(one())

        threads = [threading.Thread(target=run) for _ in range(slots)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while (stats := wide.health().json()["stats"])["active"] + stats["queued"] < slots:
            if time.monotonic() > deadline or len(results) == slots:
                break
            time.sleep(0.005)
        extra = httpx.post(wide.url + CHAT, json=_body(max_tokens=2), timeout=60)
        for thread in threads:
            thread.join(60)
        assert sorted(r.status_code for r in results) == [200] * slots, [
            r.text for r in results if r.status_code != 200
        ]
        if len(results) == slots and extra.status_code == 200:
            continue  # the burst ended before the extra request arrived: try again
        _assert_error(extra, 429, "rate_limit_error")
        break


def test_a_model_that_fails_to_load(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    app = create_app(load_settings(model=str(broken)))  # the app builds its own engine
    engine: Engine = app.state.engine
    with serve_app(app) as server:
        assert engine.wait_ready(60) is False
        health = server.health()
        assert health.status_code == 503
        assert health.json()["status"] == "failed"
        assert health.json()["error"]["message"]
        error = _assert_error(server.http().post(CHAT, json=_body()), 503, "server_error")
        assert error["code"] == "model_not_ready"
