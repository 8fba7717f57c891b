"""Shared fixtures: tiny real models on disk, and real servers on loopback.

`start_server` runs `python -m flashserve.server.cli serve` in a subprocess on a free
127.0.0.1 port and waits for /health; `serve_app` runs an app built in this
process (for a test that needs its own engine) under uvicorn in a thread.
Both are real HTTP servers: tests talk to them with httpx and the openai SDK.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from flashserve.engine.weights.synthetic import SPECIAL_TOKENS, make_model_dir

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 180.0
# The tiny models' end-of-sequence token; a logit_bias of -100 on it keeps them talking.
TINY_EOS = SPECIAL_TOKENS.index("<|im_end|>")
NO_EOS = {str(TINY_EOS): -100}


@pytest.fixture(scope="session", autouse=True)
def _private_prompt_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Apps built in this process keep prompt-cache files out of the user's cache dir,
    and stored responses out of the user's data dir."""
    os.environ["FLASHSERVE_PROMPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("prompt-cache"))
    os.environ["FLASHSERVE_DATA_DIR"] = str(tmp_path_factory.mktemp("data"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    _clients: list[Any] = field(default_factory=list)

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official SDK, without retries, so a test sees every status as it is."""
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120.0)
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="test", **kwargs)
        self._clients.append(client)
        return client

    def http(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 120.0)
        client = httpx.Client(base_url=self.url, **kwargs)
        self._clients.append(client)
        return client

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=30.0)

    @property
    def model_id(self) -> str:
        return self.health().json()["model"]

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_idle(self, timeout: float) -> dict[str, Any]:
        """Poll /health until the worker has nothing running or queued; return its body."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.health().json()
            if not body["busy"] or time.monotonic() > deadline:
                return body
            time.sleep(0.05)

    def close_clients(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLASHSERVE_")}


def start_server(model: Path | str | None, workdir: Path, *args: str) -> Server:
    """`flashserve serve` in a subprocess; returns once /health says ok."""
    port = free_port()
    log_path = workdir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "info", *args]
    if "--prompt-cache-bytes" not in args:
        # Tests measure cold prefill unless they ask for the prompt cache.
        cmd += ["--prompt-cache-bytes", "0"]
    if "--prompt-cache-dir" not in args:
        cmd += ["--prompt-cache-dir", str(workdir / "prompt-cache")]  # never the user's
    if "--data-dir" not in args:
        cmd += ["--data-dir", str(workdir / "data")]  # stored responses: never the user's
    if model is not None:
        cmd += ["--model", str(model)]
    with open(log_path, "wb") as log:
        # cwd=workdir: no stray ./config.toml is picked up.
        process = subprocess.Popen(
            cmd, cwd=workdir, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT
        )
    server = Server(url=f"http://127.0.0.1:{port}", log_path=log_path, process=process)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if server.health().status_code == 200:
                return server
        time.sleep(0.1)
    stop_server(server)
    raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    server.close_clients()
    process = server.process
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[Server]:
    """Run an ASGI app built in this process under uvicorn on a free loopback port."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("in-process server did not start")
        time.sleep(0.02)
    server = Server(url=f"http://127.0.0.1:{port}")
    try:
        yield server
    finally:
        server.close_clients()
        uv.should_exit = True
        thread.join(timeout=30)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of sample `name` on a /metrics page (summed over the samples whose
    labels include `labels`; each engine's carry `model`); None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


# -- models ---------------------------------------------------------------------------


@pytest.fixture
def float_decode_x() -> Iterator[None]:
    """decode_matmul "float" for one test, then what it was. The setting is process-wide
    and every load() sets it (int16 by default), so a test that compares the few-row
    kernel with MLX's float path to float32 rounding pins it rather than inherit it
    from whichever test ran before."""
    from flashserve.engine.compute import qmm

    ext = qmm.extension()
    before = ext.x_bits() if ext is not None and hasattr(ext, "x_bits") else 0
    qmm.set_decode_matmul("float")
    yield
    if ext is not None and hasattr(ext, "set_x_bits"):
        ext.set_x_bits(before)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def cache_arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny model per cache type: attention KV (llama, qwen3_moe), recurrent (qwen3_next)."""
    root = tmp_path_factory.mktemp("cache-archs")
    return {
        arch: make_model_dir(root / arch, arch) for arch in ("llama", "qwen3_moe", "qwen3_next")
    }


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", "qwen3_moe")


# -- servers --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """`flashserve serve --model <tiny llama>` for the whole session."""
    server = start_server(tiny_llama_dir, tmp_path_factory.mktemp("llama-server"))
    yield server
    stop_server(server)
    # Bad input, disconnects and failures are answered, never crash a handler.
    assert "Traceback" not in server.log_tail(10**7), server.log_tail()
