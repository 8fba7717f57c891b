"""Headless Chromium driven over the Chrome DevTools Protocol, for the dashboard's test.

Debian's `chromium` package, started with `--remote-debugging-port=0`; the page
target is driven over one websocket (the `websockets` package's sync client).
`find_chromium()` finds the browser, installing the package with apt when this
runs as root and it is missing (CI machines are like this one); the test skips,
with the reason, only where no browser can be had.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
APT_TIMEOUT_S = 600


def find_chromium() -> tuple[str | None, str]:
    """(path of a Chromium, "") or (None, why there is none)."""
    for name in NAMES:
        if path := shutil.which(name):
            return path, ""
    if os.name != "posix" or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None, "no chromium on PATH, and apt-get cannot install one (not root, or no apt)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-q", "chromium"])
    for cmd in steps:
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{' '.join(cmd)} failed: {exc}"
        if done.returncode != 0:
            return None, f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}"
    path = shutil.which("chromium")
    return (path, "") if path else (None, "apt-get installed chromium, but it is not on PATH")


class Browser:
    """One headless Chromium with one page; `events` collects what the page reported."""

    def __init__(self, executable: str, width: int = 1400, height: int = 1900) -> None:
        self._profile = Path(tempfile.mkdtemp(prefix="fs-chromium-"))
        self.process = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--no-sandbox",  # root in a container has no user namespaces for the sandbox
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            # Its own process group, so close() can end the helpers (crashpad, utility
            # processes) that outlive the browser and keep writing into the profile.
            start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []
        self._id = 0
        self._stack = contextlib.ExitStack()
        try:
            self._ws = self._stack.enter_context(self._connect())
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.call(f"{domain}.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
        except BaseException:
            self.close()
            raise

    def _connect(self) -> ClientConnection:
        assert self.process.stderr is not None
        deadline = time.monotonic() + 30
        port = None
        while port is None:
            line = self.process.stderr.readline()
            if not line and (self.process.poll() is not None or time.monotonic() > deadline):
                raise RuntimeError("chromium did not start its DevTools endpoint")
            if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                port = int(m.group(1))
        # Keep reading stderr so a chatty browser never blocks on a full pipe.
        _drain(self.process)
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        return connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        ident = self._id
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=60))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def pump(self, seconds: float) -> None:
        """Collect the page's events for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.events.append(json.loads(self._ws.recv(timeout=left)))
            except TimeoutError:
                return

    def navigate(self, url: str) -> None:
        seen = len(self.events)
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 30
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events[seen:]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load")
            self.pump(0.1)

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Evaluate until truthy; the last value on timeout, in the error."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} stayed {value!r}")
            self.pump(0.2)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def errors(
        self, since: int = 0, allowed: Callable[[dict[str, Any]], bool] = lambda e: False
    ) -> list[dict]:
        """Uncaught exceptions, console.error/assert calls, and error log entries (a
        failed load, a CSP violation) from event `since` on, less those `allowed` accepts."""
        found = []
        for event in self.events[since:]:
            method, params = event.get("method"), event.get("params", {})
            bad = (
                method == "Runtime.exceptionThrown"
                or (method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"))
                or (method == "Log.entryAdded" and params["entry"]["level"] == "error")
            )
            if bad and not allowed(event):
                found.append(event)
        return found

    def requests_to(self, path: str) -> list[float]:
        """Times (the browser's monotonic seconds) of the requests sent to `path`."""
        return [
            e["params"]["timestamp"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent"
            and httpx.URL(e["params"]["request"]["url"]).path == path
        ]

    def close(self) -> None:
        self._stack.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        _end_group(self.process.pid)
        _remove_profile(self._profile)


def _end_group(pgid: int) -> None:
    """Kill what is left of the browser's process group and wait until none of it runs."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, 9)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def _remove_profile(path: Path) -> None:
    """Remove the profile, retrying: a helper dying a moment late can still add a file to it."""
    for _ in range(20):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    shutil.rmtree(path, ignore_errors=True)


def _drain(process: subprocess.Popen) -> None:
    def drain() -> None:
        assert process.stderr is not None
        for _ in process.stderr:
            pass

    threading.Thread(target=drain, name="chromium-stderr", daemon=True).start()
