"""The `flashserve` commands other than serve: chat and import-gguf, run for real."""

import subprocess
import sys
from pathlib import Path

from flashserve.engine.weights.sources import default_model_path

REPO = Path(__file__).resolve().parent.parent


def flashserve(*args: str, stdin: str = "", timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashserve.server.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO / "tests",
        check=False,
    )


def test_chat_keeps_the_conversation_and_exits_on_ctrl_d(tiny_llama_dir: Path):
    proc = flashserve(
        "chat",
        "--model",
        str(tiny_llama_dir),
        "--default-max-tokens",
        "8",
        stdin="hello\nand again\n",  # then EOF, as Ctrl-D
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(">>> ") == 3  # two turns, then the prompt that read EOF
    assert "Traceback" not in proc.stderr


def test_import_gguf_writes_a_loadable_mlx_lm_dir(tmp_path: Path):
    out = tmp_path / "smollm2"
    proc = flashserve("import-gguf", str(default_model_path()), str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    again = flashserve("import-gguf", str(default_model_path()), str(out))
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1
