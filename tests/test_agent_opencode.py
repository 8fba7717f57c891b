"""The real opencode (npm opencode-ai, pinned) against the real server's /v1.

opencode runs non-interactively (`opencode run`) with a provider on
`@ai-sdk/openai-compatible` whose baseURL is the server, configured by an
opencode.json that OPENCODE_CONFIG names; HOME and the XDG dirs are under
tmp_path, so nothing of the user's is read or written. The provider sends a
ScriptQueue's header on every request, so the tiny model says exactly what
the test scripts.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .agent_install import npm_client
from .agent_servers import ONE_LAYER, make_agent_model
from .conftest import Server
from .scripted import ScriptQueue, script_queue, scripted_server

VERSION = "1.18.33"
CONTEXT = 131072
RUN_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def opencode() -> Path:
    return npm_client("opencode-ai", VERSION, "opencode")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = make_agent_model(
        tmp_path_factory.mktemp("opencode") / "tiny-qwen3", CONTEXT, **ONE_LAYER
    )
    with scripted_server(path, prompt_cache_bytes=2**30) as running:
        yield running


def opencode_config(server: Server, queue: ScriptQueue) -> dict:
    model = server.model_id
    return {
        "$schema": "https://opencode.ai/config.json",
        "model": f"flashserve/{model}",
        "small_model": f"flashserve/{model}",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "flashserve": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "flashserve",
                "options": {
                    "baseURL": server.url + "/v1",
                    "apiKey": "test-key",
                    "headers": queue.headers,
                },
                "models": {model: {"name": model, "limit": {"context": CONTEXT, "output": 1024}}},
            }
        },
    }


def run_opencode(
    opencode: Path, server: Server, queue: ScriptQueue, tmp: Path, prompt: str
) -> subprocess.CompletedProcess:
    home = tmp / "home"
    work = tmp / "work"
    home.mkdir()
    work.mkdir()
    config = tmp / "opencode.json"
    config.write_text(json.dumps(opencode_config(server, queue)))
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "OPENCODE_CONFIG": str(config),
        # No internet here: models.dev, updates, LSP downloads and plugins stay off.
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    }
    done = subprocess.run(
        [str(opencode), "run", prompt, "--print-logs"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return done


def test_plain_turn(opencode: Path, server: Server, tmp_path: Path) -> None:
    # Two requests, in either order: the session's title (small model, no
    # tools) and the turn itself; both get the same script.
    text = "Hello from the scripted model."
    queue = script_queue(text, text)
    done = run_opencode(opencode, server, queue, tmp_path, "Say hello.")
    assert done.stdout.strip() == text
    assert len(queue.bodies) == 2
    turn = next(body for body in queue.bodies if "tools" in body)
    assert turn["messages"][0]["role"] == "system"
    assert turn["messages"][-1]["role"] == "user"
    assert "Say hello." in json.dumps(turn["messages"][-1])
    assert {tool["function"]["name"] for tool in turn["tools"]} >= {"bash", "read"}
