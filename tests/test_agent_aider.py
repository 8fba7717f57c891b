"""The real aider (PyPI aider-chat, pinned) against the real server (issue 41).

aider runs one turn non-interactively (`--message`) through litellm's OpenAI
provider (/v1/chat/completions) against an in-process scripted server
(tests/agent_servers.py). The scripted model answers with an aider
SEARCH/REPLACE block, and aider applies it to the file.

aider runs offline: HOME is the test's, the model's context window and prices
come from a metadata file (aider fetches litellm's price list from GitHub for
a model it does not know), litellm reads its bundled cost map
(LITELLM_LOCAL_MODEL_COST_MAP), and update checks, analytics and release
notes are off.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .agent_install import pip_client
from .agent_servers import Exchange, agent_server, context_length, make_agent_model
from .conftest import Server
from .scripted import ScriptQueue, script_queue

AIDER = ("aider-chat", "0.86.2", "aider")
RUN_TIMEOUT_S = 240.0
MAX_OUTPUT = 4096
EDIT = """hello.py
```python
<<<<<<< SEARCH
print("hello")
=======
print("hello, flashserve")
>>>>>>> REPLACE
```"""


@pytest.fixture(scope="module")
def aider() -> Path:
    return pip_client(*AIDER)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, list[Exchange]]]:
    model = make_agent_model(tmp_path_factory.mktemp("aider") / "tiny-qwen3")
    with agent_server(model) as running:
        yield running


def aider_files(root: Path, server: Server, queue: ScriptQueue) -> list[str]:
    """The model's metadata (context window) and settings (edit format, the test's
    header) as aider reads them; returns the flags that name them."""
    name = "openai/" + server.model_id
    window = context_length(server)
    metadata = {
        name: {
            "max_input_tokens": window,
            "max_tokens": window,
            "max_output_tokens": MAX_OUTPUT,
            "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0,
            "litellm_provider": "openai",
            "mode": "chat",
        }
    }
    settings = [
        {
            "name": name,
            "edit_format": "diff",
            "extra_params": {"extra_headers": queue.headers},
        }
    ]
    # JSON is YAML: aider reads the settings file with yaml.safe_load.
    (root / "metadata.json").write_text(json.dumps(metadata))
    (root / "settings.yml").write_text(json.dumps(settings))
    return [
        f"--model-metadata-file={root / 'metadata.json'}",
        f"--model-settings-file={root / 'settings.yml'}",
    ]


def test_edit_turn_completes(
    aider: Path, served: tuple[Server, list[Exchange]], tmp_path: Path
) -> None:
    server, log = served
    queue = script_queue(EDIT)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "hello.py").write_text('print("hello")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "AIDER_"))}
    env |= {"HOME": str(home), "OPENAI_API_KEY": "unused", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cmd = [str(aider), "--model", "openai/" + server.model_id]
    cmd += ["--openai-api-base", server.url + "/v1", *aider_files(tmp_path, server, queue)]
    cmd += ["--yes-always", "--no-git", "--no-check-update", "--no-show-model-warnings"]
    cmd += ["--analytics-disable", "--no-show-release-notes", "--no-pretty", "--no-fancy-input"]
    cmd += ["--message", "Make hello.py greet flashserve.", "hello.py"]
    done = subprocess.run(
        cmd,
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "Applied edit to hello.py" in done.stdout, done.stdout[-3000:]
    assert (work / "hello.py").read_text() == 'print("hello, flashserve")\n'
    posts = [x for x in log if queue.id in x.headers.values()]
    assert [(x.method, x.path, x.status) for x in posts] == [("POST", "/v1/chat/completions", 200)]
    body = posts[0].body
    assert body["stream"] is True and body["model"] == server.model_id
    # aider sent its edit-format rules, the file's contents and the request as messages.
    messages = body["messages"]
    assert messages[0]["role"] == "system" and "SEARCH" in messages[0]["content"]
    assert any('hello.py\n```\nprint("hello")' in m["content"] for m in messages), messages
    assert messages[-1]["content"].startswith("Make hello.py greet flashserve.")
