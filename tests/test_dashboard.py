"""GET /dashboard (issue 20): the live page, in headless Chromium, on a real server.

The server is `flashserve serve` in a subprocess: a prepared tiny MoE model
with two of its four layers streamed, an expert cache of half its experts,
and an API key. The browser is Debian's `chromium` over the DevTools protocol
(tests/browser.py): the page asks for the key, polls, and shows what a few
requests did, read back from DOM values. A screenshot is kept as an artifact
(FLASHSERVE_TEST_ARTIFACTS, default tests/artifacts/, git-ignored).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flashserve.engine.weights.prepare import prepare
from flashserve.engine.weights.synthetic import make_model_dir
from flashserve.server.app import create_app
from flashserve.server.http.security import DASHBOARD_PATHS, OPEN_PATHS
from flashserve.server.routes.dashboard import FILES, PAGE
from flashserve.server.settings import Settings

from .browser import Browser, find_chromium
from .conftest import NO_EOS, REPO, Server, start_server, stop_server

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARTIFACTS = Path(os.environ.get("FLASHSERVE_TEST_ARTIFACTS") or REPO / "tests" / "artifacts")
DASHBOARD_DIR = REPO / "server" / "dashboard"


@pytest.fixture(scope="module")
def prepared_moe(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Served as "prepared": the model id is the directory's name.
    root = tmp_path_factory.mktemp("dashboard")
    return prepare(str(tiny_moe_dir), root / "prepared", expert_bits=4)


@pytest.fixture(scope="module")
def server(prepared_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        prepared_moe,
        tmp_path_factory.mktemp("dashboard-server"),
        "--api-key",
        KEY,
        "--expert-cache",
        "16",  # of 32 experts (4 layers x 8)
        "--expert-prefetch",
        "next-layer",
        "--residency",
        "fixed",
        "--resident-layers",
        "2",
        "--prompt-cache-bytes",
        "50000000",
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    path, why = find_chromium()
    if path is None:
        pytest.skip(f"no headless browser can be had here: {why}")
    browser = Browser(path)
    yield browser
    browser.close()


def completions(server: Server, count: int, tokens: int = 24) -> None:
    """`count` concurrent requests, each `tokens` tokens long (the key sent either way)."""

    def one(i: int) -> None:
        body = {
            "model": "prepared",
            "prompt": f"Request {i} about foxes",
            "max_tokens": tokens,
            "temperature": 0,
            "logit_bias": NO_EOS,
        }
        response = server.http(headers=AUTH).post("/v1/completions", json=body)
        assert response.status_code == 200, response.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def dom(browser: Browser, selector: str, attribute: str = "value") -> float:
    """A number the page keeps in a data-* attribute."""
    script = f"document.querySelector({selector!r}).dataset.{attribute}"
    return float(browser.evaluate(script))


def test_dashboard_shows_live_data_in_headless_chromium(server: Server, browser: Browser) -> None:
    start = len(browser.events)
    browser.navigate(server.url + PAGE)
    # The key: asked for once, kept in the tab's sessionStorage only.
    browser.wait_for("!document.getElementById('key-form').hidden")
    asked_at = len(browser.events)
    browser.evaluate(
        f"document.getElementById('key-input').value = {KEY!r};"
        "document.getElementById('key-form').requestSubmit()"
    )
    browser.wait_for("document.getElementById('status').dataset.state === 'ok'")
    assert browser.evaluate("sessionStorage.getItem('flashserve.apiKey')") == KEY
    assert browser.evaluate("localStorage.length") == 0
    assert browser.evaluate("document.getElementById('info-model').textContent") == "prepared"
    assert browser.evaluate("document.getElementById('info-version').textContent") == "0.1.0"
    assert browser.evaluate("document.getElementById('info-expert-cache').textContent") == "16"

    completions(server, 3)
    # The next poll sees the tokens: every chart and panel shows non-zero numbers.
    browser.wait_for("Number(document.getElementById('chart-throughput').dataset.max) > 0")
    browser.wait_for("Number(document.getElementById('heatmap').dataset.total) > 0")
    completions(server, 2)
    browser.wait_for("Number(document.getElementById('chart-throughput').dataset.points) >= 3")
    assert dom(browser, "#chart-throughput", "max") > 0  # decode tokens/s
    assert dom(browser, "#ttft") > 0
    assert dom(browser, "#decode-tps") > 0
    assert dom(browser, "#batch-size") >= 1
    # Speculative decoding is off on this server: its tiles say so.
    assert browser.evaluate("document.getElementById('spec-accepted').textContent") == "off"
    assert dom(browser, "#chart-memory", "max") > 0
    assert dom(browser, "#chart-experts", "maxAny") > 0  # hit rate / served from memory
    assert 0 < dom(browser, "#served-rate") <= 1
    assert 0 <= dom(browser, "#hit-rate") <= 1
    assert 0 <= dom(browser, "#io-wait") <= 1
    assert dom(browser, "#occupancy") > 0
    assert dom(browser, "#disk-gbps") > 0
    # Memory, part by part, against the limit.
    parts = browser.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#memory-bar .seg')]"
        ".map(e => [e.dataset.part, Number(e.dataset.bytes)]))"
    )
    assert set(parts) == {"non_layer", "layers", "experts", "prompt", "kv", "buffers", "rest"}
    for part in ("non_layer", "layers", "experts", "prompt", "rest"):
        assert parts[part] > 0, parts
    assert dom(browser, "#memory-bar", "limit") >= sum(parts.values())
    # One cell per decoder layer: 0 and 1 resident, 2 and 3 streamed; all read bytes.
    cells = browser.evaluate(
        "[...document.querySelectorAll('#residency-strip .cell')]"
        ".map(e => [Number(e.dataset.layer), e.dataset.state, Number(e.dataset.readBytes)])"
    )
    assert [(i, state) for i, state, _ in cells] == [
        (0, "resident"),
        (1, "resident"),
        (2, "streamed"),
        (3, "streamed"),
    ]
    assert all(read > 0 for _, _, read in cells), cells
    assert cells[2][2] > cells[0][2]  # a streamed layer reads its file too
    assert browser.evaluate("document.getElementById('heatmap-labels').childElementCount") == 4

    # At most one round a second, and none while the tab is hidden.
    browser.pump(2.5)
    polls = browser.requests_to("/memory")
    assert all(b - a >= 0.95 for a, b in itertools.pairwise(polls)), polls
    browser.evaluate(
        "Object.defineProperty(document, 'hidden', {value: true, configurable: true});"
        "document.dispatchEvent(new Event('visibilitychange'))"
    )
    browser.pump(0.3)  # a round in flight when the tab hid may still finish
    hidden_from = len(browser.requests_to("/memory"))
    browser.pump(2.2)
    assert len(browser.requests_to("/memory")) == hidden_from
    assert browser.evaluate("document.getElementById('status').dataset.state") == "paused"
    browser.evaluate(
        "Object.defineProperty(document, 'hidden', {value: false, configurable: true});"
        "document.dispatchEvent(new Event('visibilitychange'))"
    )
    browser.wait_for("document.getElementById('status').dataset.state === 'ok'")

    shot = browser.screenshot(ARTIFACTS / "dashboard.png")
    assert shot.stat().st_size > 20_000

    # No console errors, no exceptions, no CSP violations. Before the key, the first
    # round's keyed requests were refused (401): the browser logs those, as it should.
    def refused_before_key(event: dict) -> bool:
        entry = event.get("params", {}).get("entry", {})
        return (
            browser.events.index(event) < asked_at
            and entry.get("source") == "network"
            and "401" in entry.get("text", "")
        )

    assert browser.errors(since=start, allowed=refused_before_key) == []


def test_shedding_events_are_marked_without_a_key(
    prepared_moe: Path, browser: Browser, tmp_path: Path
) -> None:
    """A keyless server never asks for a key. Memory pressure (a shed floor above any
    machine's memory) sheds a resident layer: the event is listed, marked on every
    time chart, and the strip shows the layer streamed."""
    server = start_server(
        prepared_moe,
        tmp_path,
        "--expert-cache",
        "16",
        "--residency",
        "fixed",
        "--resident-layers",
        "2",
        "--shed-floor",
        "1000TB",
    )
    try:
        start = len(browser.events)
        browser.navigate(server.url + PAGE)
        browser.wait_for("document.getElementById('status').dataset.state === 'ok'")
        browser.wait_for("document.querySelectorAll('#residency-strip .cell').length === 4")
        completions(server, 1, tokens=72)  # memory is checked every 64 decode steps
        browser.wait_for("document.querySelectorAll('#shed-events li').length > 0")
        browser.wait_for("Number(document.getElementById('chart-memory').dataset.sheds) > 0")
        for chart in ("throughput", "requests", "memory", "experts"):
            assert dom(browser, f"#chart-{chart}", "sheds") >= 1, chart
        event = server.http().get("/memory").json()["shedding_events"][0]
        assert event["shed_layers"] == [1]  # a quarter of the resident layers, highest first
        listed = browser.evaluate("document.querySelector('#shed-events li').dataset.time")
        assert float(listed) == event["time"]
        assert "shed layers 1" in browser.evaluate(
            "document.querySelector('#shed-events li').textContent"
        )
        state = "document.querySelector('#residency-strip .cell[data-layer=\"1\"]').dataset.state"
        browser.wait_for(f"{state} === 'streamed'")
        assert browser.evaluate("document.getElementById('key-form').hidden") is True
        assert browser.evaluate("sessionStorage.length") == 0
        assert browser.errors(since=start) == []
    finally:
        stop_server(server)


def test_page_is_open_data_stays_keyed(server: Server) -> None:
    """The page and its files need no key (they hold no data); every data route does."""
    http = server.http()
    page = http.get(PAGE)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    for name, media_type in FILES.items():
        response = http.get(f"{PAGE}/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"] == media_type
        assert response.content == (DASHBOARD_DIR / name).read_bytes()
    assert http.head(PAGE).status_code == 200
    for path in ("/dashboard/info", "/memory", "/cache/stats", "/metrics", "/dashboard/x.js"):
        assert http.get(path).status_code == 401, path
    info = http.get("/dashboard/info", headers=AUTH)
    assert info.status_code == 200
    body = info.json()
    assert body["version"] == "0.1.0" and body["model"] == "prepared"
    assert body["settings"]["residency"] == "fixed" and body["settings"]["resident_layers"] == 2
    assert body["settings"]["expert_cache"] == "16"
    assert body["blas"] in ("mkl", "reference", "accelerate")


def test_memory_reports_bytes_read_per_layer(server: Server) -> None:
    completions(server, 1, tokens=8)
    body = server.http(headers=AUTH).get("/memory").json()
    reads = body["layer_bytes_read"]
    assert len(reads) == body["num_layers"] == 4
    assert reads[0] == reads[1] == 0  # resident layers are never read again
    assert reads[2] > 0 and reads[3] > 0
    assert sum(reads) == body["streaming"]["bytes_read"]
    metrics = server.http(headers=AUTH).get("/metrics").text
    assert "layer_bytes_read" not in metrics  # a per-layer list is no gauge


def test_host_check_and_cors_without_a_key() -> None:
    """A keyless server answers the page only under names it knows (DNS rebinding), and
    gives no other origin CORS access to it."""
    settings = Settings(model="unused", api_key=None, api_key_file=None, allowed_hosts=[])
    app = create_app(settings)  # never started: the page needs no model

    async def check() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            assert (await http.get(PAGE)).status_code == 200
            assert (await http.get(PAGE, headers={"Host": "localhost:8000"})).status_code == 200
            refused = await http.get(PAGE, headers={"Host": "evil.example"})
            assert refused.status_code == 400 and refused.json()["error"]["message"]
            cross = await http.get(PAGE, headers={"Origin": "http://evil.example"})
            assert "access-control-allow-origin" not in cross.headers
            assert (await http.get("/dashboard/info")).status_code == 503  # no model loaded
            missing = await http.get("/dashboard/nothing.js")
            assert missing.status_code == 404 and missing.json()["error"]

    asyncio.run(check())


def test_open_paths_are_the_page_and_its_files_only() -> None:
    assert {PAGE, *(f"{PAGE}/{name}" for name in FILES)} == DASHBOARD_PATHS
    assert DASHBOARD_PATHS <= OPEN_PATHS and "/dashboard/info" not in OPEN_PATHS
    html = (DASHBOARD_DIR / "index.html").read_text()
    linked = set(re.findall(r'(?:src|href)="/dashboard/([^"]+)"', html))
    assert linked == set(FILES)
    # CSP: no inline script or style anywhere in the page.
    assert re.findall(r"<script(?![^>]*\bsrc=)", html) == []
    assert " style=" not in html and "<style" not in html
    assert (DASHBOARD_DIR / "uPlot.LICENSE").read_text().startswith("The MIT License")


def test_dashboard_files_are_package_data() -> None:
    """`pip install .` ships every file of the page (pyproject's package-data)."""
    with open(REPO / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["flashserve.server"]
    shipped = {p for pattern in data for p in (REPO / "server").glob(pattern) if p.is_file()}
    on_disk = {p for p in DASHBOARD_DIR.iterdir() if p.is_file()}
    assert on_disk == shipped
    assert {"index.html", "uPlot.LICENSE", *FILES} <= {p.name for p in on_disk}


def test_dashboard_picks_among_several_models(
    tiny_llama_dir: Path, tmp_path: Path, browser: Browser
) -> None:
    """With several models the page shows one (`?model=`, by default the --model) and a
    picker of the loaded ones; its /memory, /cache/stats and metrics are that model's."""
    models = tmp_path / "models"
    make_model_dir(models / "tiny-qwen3", "qwen3", seed=5)
    server = start_server(tiny_llama_dir, tmp_path, "--models-dir", str(models))
    try:
        pick = "document.getElementById('model-pick')"
        browser.navigate(server.url + PAGE)
        browser.wait_for("document.getElementById('status').dataset.state === 'ok'")
        assert browser.evaluate("document.getElementById('info-model').textContent") == (
            "tiny-llama"
        )
        assert browser.evaluate(f"{pick}.hidden") is True  # one model loaded
        body = {"model": "tiny-qwen3", "prompt": "hi", "max_tokens": 4, "temperature": 0}
        assert server.http().post("/v1/completions", json=body).status_code == 200
        browser.wait_for(f"!{pick}.hidden && {pick}.options.length === 2")
        browser.navigate(server.url + PAGE + "?model=tiny-qwen3")
        browser.wait_for("document.getElementById('status').dataset.state === 'ok'")
        assert browser.evaluate("document.getElementById('info-model').textContent") == (
            "tiny-qwen3"
        )
        assert browser.evaluate(f"{pick}.value") == "tiny-qwen3"
        asked = {
            e["params"]["request"]["url"].removeprefix(server.url)
            for e in browser.events
            if e.get("method") == "Network.requestWillBeSent"
        }
        assert {"/memory?model=tiny-qwen3", "/cache/stats?model=tiny-qwen3"} <= asked
    finally:
        stop_server(server)
