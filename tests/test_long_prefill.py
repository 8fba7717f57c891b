"""A long first prefill, as coding agents send it: every dialect keeps the client
alive with events, and a client that gives up and retries resumes.

Agents' first prompts run to tens of thousands of tokens; their clients
abandon a stream that sends no event for a while (Codex's
stream_idle_timeout_ms counts events, not SSE comments) and retry. The
default model (SmolLM2-135M, a real GGUF) prefills one long prompt per
dialect at once, sized from a measured rate so that every first token
comes after more than 25 s: no gap between SSE data events may exceed 10 s.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from .conftest import Server, start_server, stop_server

MIN_PREFILL_S = 25.0
MAX_GAP_S = 10.0
TARGET_S = 40.0  # the batch's whole prefill: each first token comes well after 25 s
WORD = " ledger"  # one token in SmolLM2's vocabulary
# Each prompt inside the model's 8,192-token context (the template's tokens aside): on a
# quiet machine the integer prompt GEMM measured ~900 tokens/s, and a prompt sized from
# that alone ran past the context (a 400). Four such prompts still prefill for ~35 s.
MAX_WORDS = 8000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The default stream_keepalive (5 s); the prompt cache on, for the retry.
    running = start_server(
        None, tmp_path_factory.mktemp("long-prefill"), "--prompt-cache-bytes", "2000000000"
    )
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def rate(server: Server) -> float:
    """Prompt tokens per second of this machine, now: a cold prompt of three chunks
    (later chunks attend to the earlier ones, as a long prompt's do)."""
    http = server.http()
    prompt = "Calibrate." + WORD * 1200
    started = time.monotonic()
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": 1}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    return usage["prompt_tokens"] / (time.monotonic() - started)


def first_output(dialect: str, event: dict[str, Any]) -> bool:
    """Whether `event` is the first one after the prefill: it carries output, or the
    end (a greedy answer may be an end-of-turn token straight away)."""
    if dialect == "chat":
        return any(
            c["delta"].get("content") or c["finish_reason"] for c in event.get("choices", [])
        )
    if dialect == "completions":
        return any(c.get("text") or c["finish_reason"] for c in event.get("choices", []))
    if dialect == "responses":
        return event["type"] not in ("response.created", "response.in_progress")
    return event["type"] not in ("message_start", "ping")


def request(dialect: str, model: str, text: str) -> tuple[str, dict[str, Any]]:
    if dialect == "chat":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
        return "/v1/chat/completions", body | {"model": model, "stream": True}
    if dialect == "completions":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": 2, "stream": True}
    if dialect == "responses":
        return "/v1/responses", {
            "model": model,
            "input": text,
            "max_output_tokens": 2,
            "stream": True,
        }
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "stream": True}
    return "/v1/messages", body | {"model": model}


DIALECTS = ("chat", "completions", "responses", "messages")


@pytest.fixture(scope="module")
def timelines(server: Server, rate: float) -> dict[str, dict[str, Any]]:
    """Each dialect's SSE data events until its first token (seconds from its start),
    all four prefilled together."""
    words = min(int(rate * TARGET_S / len(DIALECTS)), MAX_WORDS)
    out: dict[str, dict[str, Any]] = {}

    def run(dialect: str, index: int) -> None:
        # Different text per dialect: no prompt reuses another's prefix.
        path, body = request(dialect, server.model_id, f"Request {index}." + WORD * words)
        times: list[float] = []
        started = time.monotonic()
        with (
            httpx.Client(base_url=server.url, timeout=600) as http,
            http.stream("POST", path, json=body) as response,
        ):
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments and event names are no events
                times.append(time.monotonic() - started)
                if first_output(dialect, json.loads(line[5:])):
                    break
        out[dialect] = {"times": times, "status": response.status_code}

    threads = [threading.Thread(target=run, args=(d, i)) for i, d in enumerate(DIALECTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return out


@pytest.mark.parametrize("dialect", DIALECTS)
def test_no_gap_between_events_during_a_long_prefill(
    timelines: dict[str, dict[str, Any]], dialect: str
) -> None:
    timeline = timelines[dialect]
    times = timeline["times"]
    assert timeline["status"] == 200, timeline
    assert times[-1] > MIN_PREFILL_S, f"first token after {times[-1]:.1f} s: no long prefill"
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert max(gaps) <= MAX_GAP_S, gaps
    print(f"{dialect}: first token after {times[-1]:.1f} s, {len(times)} events before it")


def wait_for(check: Callable[[], bool], timeout: float) -> float:
    """Seconds until `check()` holds (raises past `timeout`)."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - started


def in_flight(server: Server) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    line = next(x for x in metrics.splitlines() if x.startswith("flashserve_requests_in_flight"))
    return float(line.split()[-1])


def test_a_retry_after_a_dropped_prefill_resumes_from_its_prefix(
    server: Server, rate: float, timelines: dict[str, Any]
) -> None:
    del timelines  # runs after them: the server is idle
    # Some 30 s of prefill (within the 8k context): several chunks of 512 tokens.
    words = min(int(rate * 30), 6000)
    body = {
        "model": server.model_id,
        "messages": [{"role": "user", "content": "Retry me." + WORD * words}],
        "max_tokens": 4,
        "temperature": 0,
    }
    http = server.http()
    prefilled_before = server.health().json()["stats"]["prefill_tokens_total"]
    reused_before = http.get("/cache/stats").json()["prompt_cache"]["tokens_reused"]
    started = time.monotonic()
    with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        for _ in response.iter_lines():
            if time.monotonic() - started > words / rate / 2:  # gave up, as idle timers do
                break
    # The server sees the client go within a second (not at its next write).
    assert wait_for(lambda: in_flight(server) == 0, 1.0) < 1.0
    retry = http.post("/v1/chat/completions", json=body).json()
    cached = retry["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 512, retry["usage"]  # at least one chunk of the dropped prefill
    assert cached < retry["usage"]["prompt_tokens"]
    # Both tries together prefilled the prompt once, less what the first try found
    # cached (the chat template's start, shared with earlier requests): the dropped
    # one is counted for what it prefilled, not for its whole prompt.
    prefilled = server.health().json()["stats"]["prefill_tokens_total"] - prefilled_before
    reused = http.get("/cache/stats").json()["prompt_cache"]["tokens_reused"] - reused_before
    first_try_reused = reused - cached
    assert 0 <= first_try_reused < 512
    assert prefilled == retry["usage"]["prompt_tokens"] - first_try_reused
