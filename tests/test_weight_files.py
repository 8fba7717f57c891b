"""Prepared weight files that go bad: checksums at load and at read, stalled reads,
and the refusals of `prepare` and of a prepared directory without its manifest.

The servers are real (`flashserve serve` in a subprocess); the damage is real
too: bytes overwritten in place (same size), a FIFO in place of a layer file
(a read that blocks, as on hung network storage).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest

from flashserve.engine.config import EngineConfig
from flashserve.engine.experts.store import ExpertReadError, _TimedRead
from flashserve.engine.loader import load
from flashserve.engine.weights.layout import MANIFEST_NAME, read_safetensors_header
from flashserve.engine.weights.model import ModelLoadError
from flashserve.engine.weights.reader import WeightFileError
from tests.conftest import NO_EOS, Server, _clean_env, free_port, start_server, stop_server
from tests.streaming_fixtures import prepared_model, source_model

CHAT = "/v1/chat/completions"
BODY = {
    "messages": [{"role": "user", "content": "Say something"}],
    "max_tokens": 6,
    "temperature": 0,
    "logit_bias": NO_EOS,
}


@pytest.fixture
def prepared(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A private copy of the prepared tiny llama (4 layers), free to damage."""
    out = tmp_path / "prepared"
    shutil.copytree(prepared_model(tmp_path_factory, "llama"), out)
    return out


def _corrupt(file: Path, nbytes: int = 2304) -> bytes:
    """Flip `nbytes` bytes in the middle of the tensor data, same size; return the original."""
    original = file.read_bytes()
    start, _ = read_safetensors_header(file)
    at = start + (len(original) - start - nbytes) // 2
    assert at > start and at + nbytes < len(original)
    damaged = bytearray(original)
    damaged[at : at + nbytes] = bytes(b ^ 0x5A for b in damaged[at : at + nbytes])
    file.write_bytes(bytes(damaged))
    assert file.stat().st_size == len(original)
    return original


def _timed_health(server: Server) -> float:
    start = time.monotonic()
    response = httpx.get(server.url + "/health", timeout=5.0)
    assert response.status_code == 200
    return time.monotonic() - start


def test_corrupt_streamed_layer_fails_its_requests_naming_the_file(prepared, tmp_path):
    layer = prepared / "layers" / "layer_0003.safetensors"
    original = _corrupt(layer)  # layers 2 and 3 stream: the size check at startup passes
    server = start_server(prepared, tmp_path, "--resident-layers", "2")
    try:
        http = server.http()
        for _ in range(2):  # every request that reads the layer fails, clearly
            response = http.post(CHAT, json=BODY)
            assert response.status_code == 500, response.text
            message = response.json()["error"]["message"]
            assert "layers/layer_0003.safetensors" in message and "checksum" in message
            assert _timed_health(server) < 0.5
        assert http.get("/memory").status_code == 200
        # The server itself is fine: once the file is good again, requests answer.
        layer.write_bytes(original)
        assert http.post(CHAT, json=BODY).status_code == 200
    finally:
        stop_server(server)


def _serve_until_exit(model: Path, workdir: Path, timeout: float = 120.0) -> tuple[int, str]:
    """`flashserve serve` expected to stop by itself; (exit code, its output)."""
    cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--model", str(model)]
    cmd += ["--port", str(free_port()), "--prompt-cache-bytes", "0"]
    proc = subprocess.run(
        cmd, cwd=workdir, env=_clean_env(), capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_corrupt_resident_file_stops_startup_naming_the_file(prepared, tmp_path):
    _corrupt(prepared / "non_layer.safetensors")
    code, output = _serve_until_exit(prepared, tmp_path)
    last = output.strip().splitlines()[-1]
    assert "non_layer.safetensors" in last and "checksum" in last, output[-3000:]
    assert "Traceback" not in output
    assert code == 2, output[-3000:]


def test_corrupt_resident_layer_refuses_to_load(prepared):
    _corrupt(prepared / "layers" / "layer_0001.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers/layer_0001\.safetensors.*checksum"):
        load(EngineConfig(model=str(prepared)))  # every layer resident: all are read now


def test_corrupt_expert_record_fails_the_streamed_moe_layer(tmp_path_factory, tmp_path):
    out = tmp_path / "moe"
    shutil.copytree(prepared_model(tmp_path_factory, "qwen3_moe"), out)
    loaded = load(EngineConfig(model=str(out), resident_layers=0))  # experts travel with layers
    reference = _greedy(loaded)
    file = out / "experts" / "layer_0002.safetensors"
    original = _corrupt(file)
    with pytest.raises(WeightFileError, match=r"experts/layer_0002\.safetensors.*checksum"):
        _greedy(loaded)
    file.write_bytes(original)  # the next read is whole again: the same tokens
    assert _greedy(loaded) == reference


def test_stalled_expert_read_names_the_expert_and_file():
    future = _TimedRead(0.2, "expert 3 of layer 1 (experts/layer_0001.safetensors)")
    started = time.monotonic()
    with pytest.raises(ExpertReadError, match=r"expert 3 of layer 1 .*stalled"):
        future.result()  # never completes: the read is stuck
    assert time.monotonic() - started < 2.0


def _greedy(loaded, tokens: int = 8) -> list[int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    steps = generate_step(
        mx.array([5, 17, 42, 99]), loaded.model, max_tokens=tokens, sampler=make_sampler(0.0)
    )
    return [int(t) for t, _ in steps]


def test_manifest_without_checksums_loads_with_one_warning(prepared, caplog):
    reference = _greedy(load(EngineConfig(model=str(prepared), resident_layers=1)))
    manifest = json.loads((prepared / MANIFEST_NAME).read_text())
    assert "checksums" in manifest  # this flashserve writes them
    manifest.pop("checksums")
    for entry in [manifest["non_layer"], *manifest["layers"]]:
        entry.pop("crc32")
    manifest.pop("files", None)
    (prepared / MANIFEST_NAME).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        loaded = load(EngineConfig(model=str(prepared), resident_layers=1))
        assert _greedy(loaded) == reference
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    about = [w for w in warnings if "checksum" in w]
    assert len(about) == 1, warnings
    assert "flashserve prepare" in about[0] and "--force" in about[0]


def test_stalled_layer_read_fails_the_request_and_the_server_stays_responsive(prepared, tmp_path):
    server = start_server(prepared, tmp_path, "--resident-layers", "2", "--io-timeout", "1")
    layer = prepared / "layers" / "layer_0003.safetensors"
    try:
        http = server.http()
        assert http.post(CHAT, json=BODY).status_code == 200
        # Hung storage: opening the file for reading now blocks until a writer comes.
        layer.unlink()
        os.mkfifo(layer)
        result: dict = {}

        def ask() -> None:
            start = time.monotonic()
            result["response"] = httpx.post(server.url + CHAT, json=BODY, timeout=60)
            result["seconds"] = time.monotonic() - start

        took = []
        for _ in range(2):
            thread = threading.Thread(target=ask)
            thread.start()
            slowest = 0.0
            while thread.is_alive():
                slowest = max(slowest, _timed_health(server))
                thread.join(0.1)
            response = result["response"]
            assert response.status_code == 500, response.text
            message = response.json()["error"]["message"]
            assert "layers/layer_0003.safetensors" in message and "stalled" in message
            took.append(result["seconds"])
            # A loop blocked on the stalled read would take io_timeout (1 s); a loaded
            # 2-core machine (CI beside other jobs) answers in up to ~0.5 s.
            assert slowest < 0.9
        # The first waits out io_timeout; the second fails at once (the first read
        # is still stuck: no second thread is spent on the same file).
        assert 1.0 <= took[0] < 6.0 and took[1] < 1.0, took
        # SIGTERM still ends the process, though a read thread is stuck in the FIFO.
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=15)
        assert time.monotonic() - started < 10
    finally:
        stop_server(server)
        with contextlib.suppress(OSError):  # a reader stuck in open() would be let go
            os.close(os.open(layer, os.O_WRONLY | os.O_NONBLOCK))


# -- refusals --------------------------------------------------------------------------


def test_prepare_into_non_empty_dir_is_one_line_and_exit_2(tmp_path_factory, tmp_path):
    src = source_model(tmp_path_factory, "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    proc = subprocess.run(
        [sys.executable, "-m", "flashserve.server.cli", "prepare", str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(),
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not empty" in lines[0] and "--force" in lines[0], proc.stderr
    assert (out / "keep.txt").read_text() == "user data"


def test_prepared_dir_without_manifest_says_so(prepared):
    (prepared / MANIFEST_NAME).unlink()
    with pytest.raises(ModelLoadError, match=r"manifest\.json") as info:
        load(EngineConfig(model=str(prepared)))
    message = str(info.value)
    assert "missing" in message and "flashserve prepare" in message
    assert "No safetensors" not in message
