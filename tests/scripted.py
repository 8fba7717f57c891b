"""Test-only helpers: tiny models with real chat templates, and scripted output.

A tiny random-weight model says nothing useful, so tests script it: an
in-process server whose app overrides the dependency
`request_logits_processors` (server/http/deps.py, a seam for applications
embedding the app) adds a ForcedTokens logits processor to a request that
sends the header `x-test-script` (a JSON string). The model then emits
exactly that text, token by token, through the real generation,
detokenization and parsing path. Only these test servers install the
override, so a real server never honours the header.

Client libraries that make several requests from one configured client (a
tool round trip, a validation retry) cannot change a header per request. For
them a ScriptQueue holds one script per request, in order: the client sends
the queue's fixed header `x-test-script-queue` (its id) on every request, and
each request takes the next script. The queue also keeps every request body
it served, so a test sees the history a library sent back.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from flashserve.engine.generation.constraints import ForcedTokens
from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.synthetic import make_model_dir
from flashserve.server.http.deps import ReadyModel, request_logits_processors
from flashserve.server.http.errors import APIError

from .conftest import Server, serve_app

FIXTURES = Path(__file__).parent / "fixtures"
SCRIPT_HEADER = "x-test-script"
QUEUE_HEADER = "x-test-script-queue"

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


@dataclass
class ScriptQueue:
    """One script per request, taken in order by requests that send `headers`."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    scripts: deque[str] = field(default_factory=deque)
    bodies: list[dict[str, Any]] = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        """The header a client sends on every request (a client's default headers)."""
        return {QUEUE_HEADER: self.id}

    def push(self, *texts: str) -> ScriptQueue:
        self.scripts.extend(texts)
        return self


# Queues by id: the scripted servers run in this process, so the dependency sees them.
_QUEUES: dict[str, ScriptQueue] = {}
_QUEUES_LOCK = threading.Lock()


def script_queue(*texts: str) -> ScriptQueue:
    """A new queue holding `texts`, one per request, that scripted servers serve."""
    queue = ScriptQueue().push(*texts)
    with _QUEUES_LOCK:
        _QUEUES[queue.id] = queue
    return queue


async def _queued_script(request: Request, queue_id: str) -> str:
    with _QUEUES_LOCK:
        queue = _QUEUES.get(queue_id)
    if queue is None:
        raise APIError(400, f"unknown test script queue {queue_id!r}")
    # The body was read and validated before dependencies ran; this reads the cache.
    queue.bodies.append(await request.json())
    with _QUEUES_LOCK:
        if not queue.scripts:
            # A request the test did not expect fails loudly instead of rambling.
            raise APIError(400, f"test script queue {queue_id!r} is empty")
        return queue.scripts.popleft()


async def _scripted_processors(request: Request, loaded: ReadyModel) -> list[Any]:
    raw = request.headers.get(SCRIPT_HEADER)
    queue_id = request.headers.get(QUEUE_HEADER)
    if raw is not None:
        text = json.loads(raw)
    elif queue_id is not None:
        text = await _queued_script(request, queue_id)
    else:
        return []
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
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
