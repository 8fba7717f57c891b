"""A bounded load test against a real server: 50 requests, 8 at a time.

Every request must get a valid answer or a clean 429 (error object and
Retry-After); the worker must survive; the server's RSS must come back near
its baseline afterwards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import NO_EOS, Server, start_server, stop_server

REQUESTS = 50
CONCURRENCY = 8
MAX_TOKENS = 16
RETRIES = 30
RETRY_WAIT_S = 0.1
# RSS may settle a little above the warm baseline (allocator caches, MLX buffer
# cache); a leak of per-request state (KV caches, handles) over 50 requests
# shows as far more.
RSS_SLACK_BYTES = 32 * 1024 * 1024

log = logging.getLogger(__name__)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/status")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def loaded_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    # 4 in the batch and 2 waiting: 8 concurrent clients overflow the queue now and then.
    server = start_server(
        tiny_llama_dir, tmp_path_factory.mktemp("load"), "--max-batch", "4", "--max-queue", "2"
    )
    yield server
    stop_server(server)


def body(i: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"request {i}: say something"}],
        "max_tokens": MAX_TOKENS,
        "logit_bias": NO_EOS,
        "temperature": 0.7,
        "seed": i,
        "stream": i % 2 == 1,
    }


async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
    """(status, 'ok' | '429') after checking that the answer is valid."""
    payload = body(i)
    async with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        raw = await response.aread()
    status = response.status_code
    if status == 429:
        error = json.loads(raw)["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1
        return status, "429"
    assert status == 200, raw[:500]
    if payload["stream"]:
        lines = [ln[5:].strip() for ln in raw.decode().splitlines() if ln.startswith("data:")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(ln) for ln in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        answer = json.loads(raw)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS
        text = answer["choices"][0]["message"]["content"]
    assert isinstance(text, str) and text
    return status, "ok"


async def run_load(url: str) -> tuple[list[tuple[int, str]], int]:
    """Every request's final outcome, and how many 429s were seen on the way."""
    limit = asyncio.Semaphore(CONCURRENCY)
    rejected = 0

    async def bounded(i: int) -> tuple[int, str]:
        nonlocal rejected
        async with limit:
            for _ in range(RETRIES):
                status, kind = await one(client, i)
                if status != 429:
                    return status, kind
                rejected += 1
                await asyncio.sleep(RETRY_WAIT_S)
            return status, kind

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        results = await asyncio.gather(*(bounded(i) for i in range(REQUESTS)))
    return results, rejected


def test_load_50_requests_8_at_a_time(loaded_server: Server) -> None:
    pid = loaded_server.process.pid  # type: ignore[union-attr]
    # Warm up (first-use allocations, kernel compilation) before the baseline.
    asyncio.run(run_load_n(loaded_server.url, 8))
    loaded_server.wait_idle(30)
    baseline = rss(pid)

    started = time.monotonic()
    results, rejected = asyncio.run(run_load(loaded_server.url))
    elapsed = time.monotonic() - started
    ok = sum(1 for _, kind in results if kind == "ok")
    # Each request ends answered, or (after RETRIES clean 429s) still a clean 429.
    assert len(results) == REQUESTS and ok >= REQUESTS - 2, results
    assert elapsed < 120

    health = loaded_server.wait_idle(30)
    assert health["status"] == "ok" and not health["busy"] and health["queued"] == 0
    assert loaded_server.process.poll() is None  # type: ignore[union-attr]
    after = httpx.post(
        loaded_server.url + "/v1/chat/completions", json=body(999) | {"stream": False}, timeout=60
    )
    assert after.status_code == 200
    time.sleep(0.5)
    grown = rss(pid) - baseline
    log.info(
        "load: %d answered, %d x 429 on the way, %.1fs; RSS %d MiB -> %d MiB",
        ok, rejected, elapsed, baseline >> 20, (baseline + grown) >> 20,
    )  # fmt: skip
    assert grown < RSS_SLACK_BYTES, f"RSS grew by {grown >> 20} MiB"


async def run_load_n(url: str, n: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for i in range(n):
            await one(client, 1000 + i)
