"""Test-only: the real coding-agent clients, pinned, installed on first use.

Each client is installed once per machine into a cache folder outside the
repository (`FLASHSERVE_AGENTS_DIR`, default ~/.cache/flashserve-test-agents):
npm packages with `npm install --prefix`, PyPI packages into a virtual
environment of their own (their pins must not meet the project's). A client
that cannot be installed here (no npm, the registry refused, a build failed)
makes its test skip with the reason, never pass silently. A lock file keeps
two pytest processes from installing the same client at once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

log = logging.getLogger(__name__)

INSTALL_TIMEOUT_S = 900.0


def agents_dir() -> Path:
    default = Path.home() / ".cache" / "flashserve-test-agents"
    path = Path(os.environ.get("FLASHSERVE_AGENTS_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _locked(name: str) -> Iterator[Path]:
    root = agents_dir()
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield root / name
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(cmd: list[str], what: str) -> None:
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{what} could not be installed here: {exc}")
    if done.returncode != 0:
        pytest.skip(
            f"{what} could not be installed here (exit {done.returncode}): "
            f"{(done.stderr or done.stdout)[-600:]}"
        )


def npm_client(package: str, version: str, bin_name: str) -> Path:
    """The `bin_name` executable of npm `package@version` (installed if missing)."""
    if shutil.which("npm") is None:
        pytest.skip(f"{package}@{version} needs npm, which this machine lacks")
    safe = package.replace("/", "+").lstrip("@")
    with _locked(f"npm-{safe}-{version}") as prefix:
        binary = prefix / "node_modules" / ".bin" / bin_name
        if not binary.exists():
            log.info("installing %s@%s into %s", package, version, prefix)
            prefix.mkdir(parents=True, exist_ok=True)
            cmd = ["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund"]
            _run([*cmd, f"{package}@{version}"], f"{package}@{version}")
        if not binary.exists():
            pytest.skip(f"{package}@{version} installed no {bin_name} executable")
    return binary


def pip_client(package: str, version: str, bin_name: str) -> Path:
    """The `bin_name` executable of PyPI `package==version`, in a venv of its own."""
    with _locked(f"pip-{package}-{version}") as venv:
        binary = venv / "bin" / bin_name
        if not binary.exists():
            log.info("installing %s==%s into %s", package, version, venv)
            _run([sys.executable, "-m", "venv", "--clear", str(venv)], f"a venv for {package}")
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
            _run([*pip, f"{package}=={version}"], f"{package}=={version}")
        if not binary.exists():
            pytest.skip(f"{package}=={version} installed no {bin_name} executable")
    return binary
