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
