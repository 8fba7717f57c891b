"""Memory limits from cgroups: the probe on fake v1 and v2 trees, and a real server
in a real cgroup v1 group whose limit is smaller than the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flashserve.engine.streaming.memory import cgroup_memory, system_memory
from tests.conftest import NO_EOS, Server, _clean_env, free_port, stop_server
from tests.streaming_fixtures import big_llama

MB = 1024 * 1024
V1_UNLIMITED = 9223372036854771712


def _write(directory: Path, **files: str | int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name.replace("__", ".")).write_text(f"{value}\n")
    return directory


def _v1_stat(inactive_file: int, active_file: int) -> str:
    # The hierarchical totals are what count; the local ones must not be used.
    return (
        f"cache 1\nrss 2\ninactive_file 7\nactive_file 7\n"
        f"total_inactive_file {inactive_file}\ntotal_active_file {active_file}\n"
    )


def _v1_tree(root: Path, group_limit: int, parent_limit: int = V1_UNLIMITED) -> Path:
    mount = root / "memory"
    for directory, limit, usage, stat in (
        (mount, V1_UNLIMITED, 900 * MB, _v1_stat(0, 0)),
        (mount / "pods", parent_limit, 700 * MB, _v1_stat(50 * MB, 0)),
        (mount / "pods" / "app", group_limit, 600 * MB, _v1_stat(100 * MB, 50 * MB)),
    ):
        _write(
            directory,
            memory__limit_in_bytes=limit,
            memory__usage_in_bytes=usage,
            memory__stat=stat,
        )
    (root / "cpu,cpuacct").mkdir()
    return _write(root, self_cgroup="12:cpu,cpuacct:/pods/app\n4:memory:/pods/app\n0::/\n")


def test_v1_limit_with_reclaimable_page_cache(tmp_path):
    me = _v1_tree(tmp_path, group_limit=1000 * MB) / "self_cgroup"
    found = cgroup_memory(tmp_path, me)
    assert found is not None
    assert found.limit == 1000 * MB
    # limit - usage + the group's file pages (inactive and active), not its local stats
    assert found.available == 1000 * MB - 600 * MB + 150 * MB
    assert found.source == f"cgroup v1 {tmp_path / 'memory' / 'pods' / 'app'}"
    # The host has more than 1000 MB: the cgroup bounds what this process may use.
    memory = system_memory(tmp_path, me)
    assert memory.total == 1000 * MB and memory.limit_source == found.source
    assert memory.available <= 550 * MB


def test_v1_unlimited_group_under_a_limited_parent(tmp_path):
    me = _v1_tree(tmp_path, group_limit=V1_UNLIMITED, parent_limit=800 * MB) / "self_cgroup"
    found = cgroup_memory(tmp_path, me)
    assert found is not None and found.limit == 800 * MB
    assert found.available == 800 * MB - 700 * MB + 50 * MB
    assert found.source.endswith(str(Path("memory") / "pods"))


def test_v1_unlimited_everywhere_is_no_limit(tmp_path):
    me = _v1_tree(tmp_path, group_limit=V1_UNLIMITED) / "self_cgroup"
    assert cgroup_memory(tmp_path, me) is None
    assert system_memory(tmp_path, me).limit_source == "host"


def test_limit_above_the_host_memory_reports_the_host(tmp_path):
    me = _v1_tree(tmp_path, group_limit=1 << 50) / "self_cgroup"
    memory = system_memory(tmp_path, me)
    host = system_memory(tmp_path / "nowhere", me)
    assert memory.limit_source == "host" and memory.total == host.total


def _v2_tree(root: Path, memory_max: str, memory_high: str = "max") -> Path:
    _write(root, cgroup__controllers="cpu memory pids")  # the root has no memory.max
    _write(
        root / "system.slice" / "app.service",
        memory__max=memory_max,
        memory__high=memory_high,
        memory__current=300 * MB,
        memory__stat=f"anon 1\nfile 999\ninactive_file {40 * MB}\nactive_file {10 * MB}\n",
    )
    return _write(root, self_cgroup="0::/system.slice/app.service\n")


def test_v2_limit_and_high(tmp_path):
    me = _v2_tree(tmp_path, str(512 * MB)) / "self_cgroup"
    found = cgroup_memory(tmp_path, me)
    assert found is not None and found.limit == 512 * MB
    assert found.available == 512 * MB - 300 * MB + 50 * MB
    assert found.source == f"cgroup v2 {tmp_path / 'system.slice' / 'app.service'}"
    me = _v2_tree(tmp_path, "max", memory_high=str(400 * MB)) / "self_cgroup"
    found = cgroup_memory(tmp_path, me)
    assert found is not None and found.limit == 400 * MB


def test_v2_max_is_no_limit(tmp_path):
    me = _v2_tree(tmp_path, "max") / "self_cgroup"
    assert cgroup_memory(tmp_path, me) is None


def test_v2_namespaced_group_is_the_mount_itself(tmp_path):
    # Inside a container the group is mounted at the root and /proc/self/cgroup
    # may name a host path that does not exist here.
    _write(
        tmp_path,
        cgroup__controllers="memory",
        memory__max=256 * MB,
        memory__current=100 * MB,
        memory__stat="inactive_file 0\nactive_file 0\n",
    )
    me = _write(tmp_path / "proc", self_cgroup="0::/kubepods/burstable/pod1/abc\n")
    found = cgroup_memory(tmp_path, me / "self_cgroup")
    assert found is not None and found.limit == 256 * MB and found.available == 156 * MB


# -- a real server in a real cgroup ----------------------------------------------------

V1_MEMORY = Path("/sys/fs/cgroup/memory")
LIMIT = 256 * MB


def _make_group(limit: int = LIMIT) -> Path:
    """A fresh cgroup v1 memory group of `limit` bytes (root, v1 memory controller), or skip."""
    if sys.platform != "linux":
        pytest.skip("cgroups are Linux only")
    if os.geteuid() != 0:
        pytest.skip("creating a cgroup needs root")
    if not (V1_MEMORY / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller at /sys/fs/cgroup/memory")
    group = V1_MEMORY / f"flashserve-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        pytest.skip(f"cannot create a cgroup under {V1_MEMORY}: {exc}")
    return group


def _start_in_group(group: Path, model: Path | None, workdir: Path, *args: str) -> Server:
    """`flashserve serve` started inside `group`: the shell joins it, then execs.
    `model` None: the models come from `args` (--models-dir)."""
    port = free_port()
    log_path = workdir / "server.log"
    serve = [sys.executable, "-m", "flashserve.server.cli", "serve", "--host", "127.0.0.1"]
    serve += ["--port", str(port), "--prompt-cache-bytes", "0", *args]
    serve += ["--model", str(model)] if model is not None else []
    cmd = ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *serve]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, cwd=workdir, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT
        )
    server = Server(url=f"http://127.0.0.1:{port}", log_path=log_path, process=process)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if server.health().status_code == 200:
                return server
        time.sleep(0.1)
    stop_server(server)
    raise AssertionError(f"server not ready:\n{server.log_tail()}")


def test_server_in_a_cgroup_plans_within_its_limit(tmp_path_factory, tmp_path):
    _, prepared = big_llama(tmp_path_factory)
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["total_bytes"] > LIMIT  # the model does not fit in the group
    group = _make_group()
    server = None
    try:
        server = _start_in_group(group, prepared, tmp_path, "--residency", "auto")
        assert (group / "cgroup.procs").read_text().split() == [str(server.process.pid)]
        http = server.http()
        memory = http.get("/memory").json()
        assert memory["memory_limit_bytes"] == LIMIT
        assert memory["memory_limit_source"] == f"cgroup v1 {group}"
        assert memory["system_total_bytes"] == LIMIT
        assert memory["system_available_bytes"] < LIMIT
        plan = memory["plan"]
        # On this host (gigabytes free) auto would keep every layer; the group cannot.
        assert plan["inputs"]["available_bytes"] < LIMIT
        assert plan["inputs"]["available_source"] == f"cgroup v1 {group}"
        assert plan["resident_count"] < manifest["num_layers"]
        assert len(memory["streamed_layers"]) > 0
        reply = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8,
                "logit_bias": NO_EOS,
            },
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        # It ran within the limit (the kernel would have killed it otherwise).
        assert server.process.poll() is None
        assert int((group / "memory.max_usage_in_bytes").read_text()) <= LIMIT
    finally:
        if server is not None:
            stop_server(server)
        _remove_group(group)


@contextlib.contextmanager
def served_in_group(limit: int, model: Path, workdir: Path, *args: str):
    """(server, group): `flashserve serve` in a fresh group of `limit` bytes, stopped
    and the group removed afterwards."""
    group = _make_group(limit)
    server = None
    try:
        server = _start_in_group(group, model, workdir, *args)
        yield server, group
    finally:
        if server is not None:
            stop_server(server)
        _remove_group(group)


def _remove_group(group: Path) -> None:
    for _ in range(50):  # the group empties once the process is reaped
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
