"""The real Claude Code (npm @anthropic-ai/claude-code, pinned) against the real server.

Claude Code runs non-interactively (`claude -p`) with its default tools and
prompt, its home and config dirs under tmp_path, and every request carrying
a ScriptQueue's header (ANTHROPIC_CUSTOM_HEADERS), so the tiny model says
exactly what each test scripts, through the real generation and parsing path.

Its first prompt is ~19k real tokens, but ~67k of the tiny model's
byte-level tokens, so the model has one layer and one attention head (a
67k-token prefill in about a second on two cores), a 256k context, and the
prompt cache on: a later turn prefills only what it adds. The image test's
model is the tiny Gemma 3 vision-language model made the same way
(tests/agent_servers.py make_agent_vlm).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .agent_install import npm_client
from .agent_servers import ONE_LAYER, images_encoded, make_agent_model, make_agent_vlm
from .conftest import Server
from .scripted import ScriptQueue, script_queue, scripted_server
from .test_tool_images import PLACEHOLDER, PNG

VERSION = "2.1.197"
# The tiny vision-language models' tokens for PNG's one pixel (engine/vision/synthetic.py):
# Gemma 3's fixed 4; Qwen's processor sizes it up to 32 x 32 pixels, one token.
TOKENS_PER_IMAGE = {"gemma3": 4, "qwen3_vl": 1}
CONTEXT = 262144
RUN_TIMEOUT_S = 420.0


@pytest.fixture(scope="module")
def claude() -> Path:
    return npm_client("@anthropic-ai/claude-code", VERSION, "claude")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = make_agent_model(
        tmp_path_factory.mktemp("claude-code") / "tiny-qwen3", CONTEXT, **ONE_LAYER
    )
    with scripted_server(path, prompt_cache_bytes=2**30) as running:
        yield running


def claude_env(home: Path, server: Server, queue: ScriptQueue) -> dict[str, str]:
    """Claude Code pointed at the server; nothing of the user's, nothing off this machine."""
    model = server.model_id
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_API_KEY": "test-key",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_CUSTOM_HEADERS": "\n".join(f"{k}: {v}" for k, v in queue.headers.items()),
        # No internet here: without these it reaches for Anthropic's telemetry,
        # error reporting and update checks.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024",
    }


def run_claude(
    claude: Path,
    server: Server,
    queue: ScriptQueue,
    tmp: Path,
    prompt: str,
    env: dict[str, str] | None = None,
) -> Any:
    home = tmp / "home"
    work = tmp / "work"
    home.mkdir()
    work.mkdir(exist_ok=True)  # a test may put files in the workspace first
    cmd = [str(claude), "-p", prompt, "--output-format", "json"]
    # Root may not skip permissions; allowing Bash by rule is what a -p run needs.
    cmd += ["--allowedTools", "Bash"]
    done = subprocess.run(
        cmd,
        cwd=work,
        env=claude_env(home, server, queue) | (env or {}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout)


def test_plain_turn(claude: Path, server: Server, tmp_path: Path) -> None:
    queue = script_queue("Hello from the scripted model.")
    result = run_claude(claude, server, queue, tmp_path, "Say hello.")
    assert result["result"] == "Hello from the scripted model."
    assert result["is_error"] is False
    # Claude Code's agent-type list comes as a system message inside `messages`.
    assert served_system_message(queue)


def served_system_message(queue: ScriptQueue) -> bool:
    return any(
        index > 0 and message["role"] == "system"
        for body in queue.bodies
        for index, message in enumerate(body["messages"])
    )


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as Qwen3 writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_background_task_notification(claude: Path, server: Server, tmp_path: Path) -> None:
    marker = tmp_path / "work" / "done.txt"
    call = tool_call(
        "Bash",
        {
            "command": f"sleep 2; echo finished > {marker}",
            "description": "Write a marker after two seconds",
            "run_in_background": True,
        },
    )
    queue = script_queue(call, "Waiting for the task.", "The background task finished.")
    result = run_claude(claude, server, queue, tmp_path, "Run the task in the background.")
    assert marker.read_text() == "finished\n"
    assert result["result"] == "The background task finished."
    assert result["is_error"] is False
    # The turn after the tool result, then the one the finished task started.
    assert len(queue.bodies) == 3
    use = queue.bodies[1]["messages"][-2]["content"][0]
    assert use["type"] == "tool_use" and use["input"]["run_in_background"] is True
    last = queue.bodies[-1]["messages"]
    assert "<task-notification>" in json.dumps(last[-1]), last[-1]
    assert last[-2] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Waiting for the task."}],
    }
    assert served_system_message(queue)


def test_read_of_a_png_goes_on(claude: Path, server: Server, tmp_path: Path) -> None:
    """Read opens a PNG; its tool_result holds the image. The text-only model reads a
    placeholder instead (a 400 would end the session: Claude Code does not retry it)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "shot.png").write_bytes(base64.b64decode(PNG))  # a 1x1 screenshot
    call = tool_call("Read", {"file_path": str(work / "shot.png")})
    queue = script_queue(call, "The screenshot is one pixel.")
    result = run_claude(claude, server, queue, tmp_path, "What is in shot.png?")
    assert result["result"] == "The screenshot is one pixel."
    assert result["is_error"] is False
    assert len(queue.bodies) == 2
    # Claude Code sent the image inside the tool_result...
    result_block = tool_result(queue.bodies[1])
    images = [part for part in result_block["content"] if part["type"] == "image"]
    assert images and images[0]["source"]["type"] == "base64", result_block
    # ...and the model's prompt held the placeholder in its place: the same request
    # with the placeholder written as text counts the same tokens; without it, fewer.
    parts = result_block["content"]
    written = [{"type": "text", "text": PLACEHOLDER} if p["type"] == "image" else p for p in parts]
    text = [part for part in parts if part["type"] != "image"]
    counts = [count_with(server, queue.bodies[1], p) for p in (parts, written, text)]
    assert counts[0] == counts[1] > counts[2], counts


def tool_result(body: dict[str, Any]) -> dict[str, Any]:
    """The tool_result block of the request's last message."""
    [block] = [
        block
        for block in body["messages"][-1]["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    return block


def count_with(server: Server, sent: dict[str, Any], parts: list[dict[str, Any]]) -> int:
    """The prompt tokens of request `sent` with its tool_result's content made `parts`."""
    result_block = tool_result(sent)
    block = {**result_block, "content": parts}
    last = {**sent["messages"][-1], "content": [
        block if part is result_block else part for part in sent["messages"][-1]["content"]
    ]}  # fmt: skip
    body = {k: sent[k] for k in ("model", "system", "tools") if k in sent}
    body["messages"] = [*sent["messages"][:-1], last]
    answer = server.http().post("/v1/messages/count_tokens", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["input_tokens"]


@pytest.fixture(scope="module", params=["gemma3", "qwen3_vl"])
def vlm_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """tests/test_images.py's tiny Gemma 3 vision-language model, made an agent's, and
    tests/test_images_qwen.py's Qwen3-VL (M-RoPE positions, deepstack)."""
    pytest.importorskip("mlx_vlm", reason="the vision extra: pip install 'flashserve[vision]'")
    out = tmp_path_factory.mktemp("claude-code-vlm") / f"tiny-{request.param}"
    path = make_agent_vlm(out, CONTEXT, request.param)
    with scripted_server(path, prompt_cache_bytes=2**30) as running:
        yield running


def test_read_of_a_png_reaches_a_vision_model(
    claude: Path, vlm_server: Server, tmp_path: Path
) -> None:
    """Read opens a PNG; the tool_result's image reaches the vision-language model: its
    tower encodes it, and the prompt holds the image's tokens."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "shot.png").write_bytes(base64.b64decode(PNG))
    queue = script_queue(tool_call("Read", {"file_path": str(work / "shot.png")}), "One pixel.")
    before = images_encoded(vlm_server)
    result = run_claude(claude, vlm_server, queue, tmp_path, "What is in shot.png?")
    assert result["result"] == "One pixel." and result["is_error"] is False, result
    assert len(queue.bodies) == 2
    sent = queue.bodies[1]
    parts = tool_result(sent)["content"]
    assert [p["type"] for p in parts if p["type"] == "image"] == ["image"]
    # The tower ran for the one image (the first request had none).
    assert images_encoded(vlm_server) == before + 1
    # The image's tokens: its placeholders and their markup, not a text placeholder.
    text = [part for part in parts if part["type"] != "image"]
    with_image, without = count_with(vlm_server, sent, parts), count_with(vlm_server, sent, text)
    tokens = TOKENS_PER_IMAGE[Path(vlm_server.model_id).name.removeprefix("tiny-")]
    assert with_image >= without + tokens + 2, (with_image, without)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A main model and a small one (by id, and by a Claude model name as its alias)."""
    root = tmp_path_factory.mktemp("claude-code-two")
    main = make_agent_model(root / "main", CONTEXT, **ONE_LAYER)
    small = make_agent_model(root / "small", CONTEXT, **ONE_LAYER)
    models = {"small": {"path": str(small), "aliases": ["claude-haiku-4-5"]}}
    with scripted_server(main, prompt_cache_bytes=2**30, models=models) as running:
        yield running


def test_haiku_requests_go_to_the_small_model(
    claude: Path, two_models: Server, tmp_path: Path
) -> None:
    """ANTHROPIC_DEFAULT_HAIKU_MODEL names the small model. In -p mode Claude Code
    2.1.197 sends it nothing of its own (no title, no command check); a subagent
    run on `haiku` does go there, and its answer comes back to the main model."""
    call = tool_call(
        "Agent", {"description": "Title the chat", "prompt": "Title it.", "model": "haiku"}
    )
    queue = script_queue(call, "A small title.", "Titled.")
    env = {"ANTHROPIC_DEFAULT_HAIKU_MODEL": "small", "ANTHROPIC_SMALL_FAST_MODEL": "small"}
    result = run_claude(claude, two_models, queue, tmp_path, "Title this chat.", env)
    assert result["result"] == "Titled." and result["is_error"] is False
    assert [body["model"] for body in queue.bodies] == ["main", "small", "main"]
    assert "A small title." in json.dumps(queue.bodies[2]["messages"][-1])
    # Served by each model's own engine: its request counter, labelled by model.
    metrics = two_models.http().get("/metrics").text
    assert 'flashserve_engine_requests_total{model="small"} 1.0' in metrics
    assert 'flashserve_engine_requests_total{model="main"} 2.0' in metrics
