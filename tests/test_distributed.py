"""One model split across two ranks on this machine (MLX's ring backend over
127.0.0.1), against the same model in one process.

`flashserve serve --hostfile` starts both ranks through mlx.launch; rank 0
serves HTTP. Greedy output through the OpenAI SDK must be token for token
what one process gives (both on the reference BLAS), for a dense model
(llama) and an MoE (qwen3_moe). Ranks started by hand (MLX_RANK and
MLX_HOSTFILE, as mlx.launch sets them) show what happens when one dies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from flashserve.engine.bench.common import free_port_run
from flashserve.engine.distributed.launch import HostfileError, check_hostfile, launch_command
from flashserve.engine.distributed.ranges import LayerSplitError, split_layers
from tests.conftest import (
    NO_EOS,
    STARTUP_TIMEOUT_S,
    Server,
    _clean_env,
    free_port,
    metric,
    start_server,
    stop_server,
)

HOSTS = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2
PROMPTS = [
    "Tell me about the sea.",
    "Count to ten, slowly.",
    "What is a pipeline?",
]


# -- layer ranges and the launcher's command line (no MLX) ------------------------------


def test_even_split_gives_leftover_layers_to_the_last_ranks():
    assert split_layers(4, 2) == [range(2), range(2, 4)]
    assert split_layers(7, 3) == [range(2), range(2, 4), range(4, 7)]
    assert split_layers(5, 2, "1,4") == [range(1), range(1, 5)]


@pytest.mark.parametrize(
    ("given", "message"),
    [("3,3", "add up to the model's 4 layers"), ("4", "names 1 ranks"), ("a,b", "comma")],
)
def test_bad_layer_split_is_named(given, message):
    with pytest.raises(LayerSplitError, match=message):
        split_layers(4, 2, given)


def test_hostfile_is_checked(tmp_path):
    good = tmp_path / "hosts.json"
    good.write_text(json.dumps(HOSTS))
    assert check_hostfile(good) == HOSTS
    cmd = launch_command(good, ["--model", "m"], port=40000)
    assert cmd[cmd.index("--backend") + 1] == "ring"
    assert cmd[cmd.index("--starting-port") + 1] == "40000"
    assert cmd[-4:] == ["flashserve.server.cli", "serve", "--model", "m"]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"ssh": "127.0.0.1"}]')
    with pytest.raises(HostfileError, match="at least two hosts"):
        check_hostfile(bad)
    bad.write_text("{nope")
    with pytest.raises(HostfileError, match="not JSON"):
        check_hostfile(bad)
    with pytest.raises(HostfileError, match="no-such"):
        check_hostfile(tmp_path / "no-such.json")


def test_serve_with_a_bad_hostfile_exits_2_naming_it(tiny_llama_dir, tmp_path):
    bad = tmp_path / "hosts.json"
    bad.write_text('[{"ips": ["127.0.0.1"]}, {"ssh": "127.0.0.1"}]')
    cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--model", str(tiny_llama_dir)]
    proc = subprocess.run(
        [*cmd, "--hostfile", str(bad)],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert 'host 0 needs an "ssh" name' in proc.stderr


# -- two ranks --------------------------------------------------------------------------


def _wait_healthy(server: Server, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"a rank exited with {process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if server.health().status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"ranks not ready in {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")


def _serve_args(model: Path, port: int, workdir: Path) -> list[str]:
    return [
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--blas",
        "reference",
        "--prompt-cache-bytes",
        "0",
        "--data-dir",
        str(workdir / "data"),
    ]


@contextlib.contextmanager
def two_ranks(model: Path, workdir: Path) -> Iterator[Server]:
    """`flashserve serve --hostfile` with two local ranks; rank 0's server."""
    hostfile = workdir / "hosts.json"
    hostfile.write_text(json.dumps(HOSTS))
    port = free_port()
    log_path = workdir / f"ranks-{port}.log"
    cmd = [sys.executable, "-m", "flashserve.server.cli", "serve", "--hostfile", str(hostfile)]
    cmd += _serve_args(model, port, workdir)
    cmd += ["--distributed-port", str(free_port_run(len(HOSTS)))]  # a port per rank
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=_clean_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(url=f"http://127.0.0.1:{port}", log_path=log_path, process=process)
    try:
        _wait_healthy(server, [process])
        yield server
    finally:
        server.close_clients()
        # SIGTERM to `serve --hostfile`: rank 0 drains, the other rank ends with it.
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            raise AssertionError(f"ranks did not stop on SIGTERM:\n{server.log_tail()}") from None


def _greedy(server: Server, prompt: str) -> tuple[str, list[str], list[float]]:
    out = server.client().chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        logit_bias=NO_EOS,
    )
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    tokens = [t.token for t in choice.logprobs.content]
    return choice.message.content or "", tokens, [t.logprob for t in choice.logprobs.content]


def _answers(server: Server) -> list[tuple[str, list[str], list[float]]]:
    """Each prompt alone, then all of them at once (one continuous batch)."""
    alone = [_greedy(server, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _greedy(server, p), PROMPTS))
    return alone + together


@pytest.mark.parametrize("arch_fixture", ["tiny_llama_dir", "tiny_moe_dir"])
def test_two_ranks_give_one_process_greedy_tokens(arch_fixture, request, tmp_path):
    model = request.getfixturevalue(arch_fixture)
    single = start_server(model, tmp_path, "--blas", "reference")
    try:
        expected = _answers(single)
    finally:
        stop_server(single)
    with two_ranks(model, tmp_path) as server:
        got = _answers(server)
        memory = server.http().get("/memory").json()
        metrics = server.http().get("/metrics").text
        client = server.client()
        with pytest.raises(openai.BadRequestError, match="split across ranks"):
            client.chat.completions.create(
                model=server.model_id,
                messages=[{"role": "user", "content": "hi"}],
                n=2,
                max_tokens=2,
            )
    for (text, tokens, logprobs), (want_text, want_tokens, want_logprobs) in zip(
        got, expected, strict=True
    ):
        assert len(tokens) == 16
        assert tokens == want_tokens
        assert text == want_text
        assert logprobs == want_logprobs  # the same logits: bit for bit
    # /memory: each rank's layers and memory.
    ranks = memory["distributed"]["ranks"]
    assert [r["layers"] for r in ranks] == [[0, 1], [2, 3]]
    assert all(r["rss_bytes"] > 0 and r["layer_weight_bytes"] > 0 for r in ranks)
    # /metrics: the hidden-state transfer time, per step.
    assert metric(metrics, "flashserve_distributed_transfer_seconds_per_step") is not None
    assert (metric(metrics, "flashserve_distributed_steps_total") or 0) > 0
    assert "Traceback" not in server.log_tail(10**7)


# -- a rank dies ------------------------------------------------------------------------


def _by_hand(model: Path, workdir: Path) -> tuple[list[subprocess.Popen], Server, list[Path]]:
    """Two ranks started by hand, as mlx.launch would: MLX_RANK and MLX_HOSTFILE."""
    ring = workdir / "ring.json"
    start = free_port_run(2)
    ring.write_text(json.dumps([[f"127.0.0.1:{start}"], [f"127.0.0.1:{start + 1}"]]))
    port = free_port()
    processes, logs = [], []
    for rank in range(2):
        env = _clean_env() | {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(ring)}
        log_path = workdir / f"rank{rank}.log"
        with open(log_path, "wb") as log:
            cmd = [sys.executable, "-m", "flashserve.server.cli", "serve"]
            cmd += _serve_args(model, port, workdir)
            processes.append(
                subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
        logs.append(log_path)
    server = Server(url=f"http://127.0.0.1:{port}", log_path=logs[0], process=processes[0])
    return processes, server, logs


@pytest.mark.parametrize("killed", [1, 0])
def test_killing_a_rank_ends_the_other_naming_it(killed, tiny_llama_dir, tmp_path):
    processes, server, logs = _by_hand(tiny_llama_dir, tmp_path)
    try:
        _wait_healthy(server, processes)
        # Serving works before the loss (rank 1 follows).
        assert _greedy(server, "hello")[1]
        other = 1 - killed
        processes[killed].send_signal(signal.SIGKILL)
        start = time.monotonic()
        code = processes[other].wait(timeout=10)
        assert time.monotonic() - start < 10
        assert code != 0
        assert f"lost rank {killed}" in logs[other].read_text()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)


def test_a_run_of_ports_for_the_ring_is_free_and_below_the_ephemeral_range() -> None:
    """mlx.launch gives rank i the port start + i: the run is bindable as a whole, and
    below the ports the kernel hands outgoing connections (a CI run lost a rank to
    one: 'Couldn't bind socket (error: 98)')."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        start = free_port_run(3)
        assert start + 3 <= low
        with contextlib.ExitStack() as stack:
            for port in range(start, start + 3):
                sock = stack.enter_context(socket.socket())
                sock.bind(("127.0.0.1", port))
