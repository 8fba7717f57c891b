"""Test-only helpers: tiny models with real chat templates, and scripted output.

A tiny random-weight model says nothing useful, so tests script it: an
in-process server whose app overrides the dependency
`request_logits_processors` (server/http/deps.py, a seam for applications
embedding the app) adds a ForcedTokens logits processor to a request that
sends the header `x-test-script` (a JSON string). The model then emits
exactly that text, token by token, through the real generation,
detokenization and parsing path. Only these test servers install the
override, so a real server never honours the header.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import Request

from flashserve.engine.generation.constraints import ForcedTokens
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.synthetic import make_model_dir
from flashserve.server.http.deps import ReadyModel, request_logits_processors

from .conftest import Server, serve_app

FIXTURES = Path(__file__).parent / "fixtures"
SCRIPT_HEADER = "x-test-script"

MISTRAL_TOKENS = [
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
]

TEMPLATES: dict[str, dict[str, Any]] = {
    "qwen3": {"chat_template": "qwen3.jinja"},
    "hermes": {"chat_template": "hermes2pro_tool_use.jinja", "bos_token": "<|endoftext|>"},
    "mistral": {
        "chat_template": "mistral_v03.jinja",
        "extra_special_tokens": MISTRAL_TOKENS,
        "bos_token": "<s>",
        "eos_token": "</s>",
    },
}


def make_templated_model(out: Path, family: str) -> Path:
    """A tiny llama whose tokenizer carries `family`'s real chat template."""
    spec = dict(TEMPLATES[family])
    spec["chat_template"] = (FIXTURES / spec["chat_template"]).read_text()
    return make_model_dir(out, "llama", **spec)


def script(text: str) -> dict[str, dict[str, str]]:
    """openai SDK kwargs that make the scripted model emit `text`."""
    return {"extra_headers": {SCRIPT_HEADER: json.dumps(text)}}


def _scripted_processors(request: Request, loaded: ReadyModel) -> list[Any]:
    raw = request.headers.get(SCRIPT_HEADER)
    if raw is None:
        return []
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(json.loads(raw), add_special_tokens=False)
    return [ForcedTokens(ids, min(tokenizer.eos_token_ids))]


@contextlib.contextmanager
def scripted_server(model: Path | None, **settings: Any) -> Iterator[Server]:
    """A real uvicorn server in this process whose chat requests can be scripted."""
    from flashserve.server.app import create_app
    from flashserve.server.settings import load_settings

    settings.setdefault("prompt_cache_bytes", 0)  # cold prefill unless a test asks
    settings.setdefault("prompt_cache_disk_bytes", 0)  # and never the user's cache dir
    loaded = load_settings(model=str(model) if model else None, **settings)
    engine = Engine(loaded.engine_config())
    app = create_app(loaded, engine)
    app.dependency_overrides[request_logits_processors] = _scripted_processors
    with serve_app(app) as server:
        if not engine.wait_ready(120):
            raise RuntimeError(f"model failed to load: {engine.load_error}")
        yield server
