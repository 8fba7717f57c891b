"""Test-only: scripted servers for the real coding-agent clients, with a wire log.

An agent client is a black box that talks HTTP: the only way to see what it
sent (and when the server's first output left) is at the server. `agent_server`
is tests/scripted.py's scripted server with an ASGI recorder in front of the
app: every exchange's method, path, headers, JSON body, status and the time
of its first output event, for assertions and for the audit of what clients
send. The model is a tiny llama with Qwen3's real chat template and a long
context: agents' prompts run to thousands of tokens.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashserve.engine.generation.worker import Engine
from flashserve.engine.weights.synthetic import make_model_dir
from flashserve.server.http.deps import request_logits_processors

from . import scripted
from .conftest import Server, metric, serve_app

CONTEXT = 131072  # a context as long as agents expect; the random model does not care
# Output events of each dialect these clients speak: the prefill is over when one leaves.
OUTPUT_MARKS = (b"event: response.output_", b'"delta":{"content"', b'"delta":{"role"')


# One layer, one head: for prompts of tens of thousands of the tiny tokenizer's
# tokens, attention is what costs (a 67k-token prefill in about a second).
ONE_LAYER = {
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
}


def make_agent_model(out: Path, context: int = CONTEXT, **overrides: Any) -> Path:
    """A tiny llama with Qwen3's chat template (Hermes tool calls) and a long context."""
    spec = dict(scripted.TEMPLATES["qwen3"])
    spec["chat_template"] = (scripted.FIXTURES / spec["chat_template"]).read_text()
    config = {"max_position_embeddings": context, **overrides}
    return make_model_dir(out, "llama", overrides=config, **spec)


def make_agent_vlm(out: Path, context: int = CONTEXT, kind: str = "gemma3") -> Path:
    """tests/test_images.py's tiny Gemma 3 vision-language model as an agent's: Qwen3's
    chat template (Hermes tool calls; the image placeholders are the template's text),
    one layer and head as ONE_LAYER's, all of its attention global over a long context.
    `kind` "qwen3_vl": tests/test_images_qwen.py's Qwen3-VL (M-RoPE positions, deepstack)."""
    from flashserve.engine.vision.synthetic import make_gemma3_vlm, make_qwen3_vl

    template = (scripted.FIXTURES / scripted.TEMPLATES["qwen3"]["chat_template"]).read_text()
    if kind == "qwen3_vl":  # two layers: both take deepstack rows; one head, as ONE_LAYER
        text = {"num_hidden_layers": 2, "num_attention_heads": 1, "num_key_value_heads": 1}
        text.update(intermediate_size=64, max_position_embeddings=context)
        return make_qwen3_vl(out, chat_template=template, text=text)
    text = {**ONE_LAYER, "head_dim": 32, "query_pre_attn_scalar": 32}
    text.update(max_position_embeddings=context, sliding_window_pattern=1)
    return make_gemma3_vlm(out, text=text, chat_template=template)


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    raw: bytes = b""
    status: int | None = None
    started: float = field(default_factory=time.monotonic)
    first_output_s: float | None = None  # seconds from the request to its first output event

    @property
    def body(self) -> Any:
        return json.loads(self.raw) if self.raw else None


class _Recorder:
    def __init__(self, app: Any, log: list[Exchange]) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        exchange = Exchange(scope["method"], scope["path"], headers)
        self.log.append(exchange)

        async def receive_body() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                exchange.raw += message.get("body", b"")
            return message

        async def send_and_time(message: Any) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            body = message.get("body", b"") if message["type"] == "http.response.body" else b""
            if exchange.first_output_s is None and any(m in body for m in OUTPUT_MARKS):
                exchange.first_output_s = time.monotonic() - exchange.started
            await send(message)

        await self.app(scope, receive_body, send_and_time)


@contextlib.contextmanager
def agent_server(model: Path, **settings: Any) -> Iterator[tuple[Server, list[Exchange]]]:
    """A scripted server (ScriptQueue header honoured) whose exchanges are logged."""
    from flashserve.server.app import create_app
    from flashserve.server.settings import load_settings

    settings.setdefault("prompt_cache_bytes", 0)
    settings.setdefault("prompt_cache_disk_bytes", 0)
    loaded = load_settings(model=str(model), **settings)
    engine = Engine(loaded.engine_config())
    app = create_app(loaded, engine)
    app.dependency_overrides[request_logits_processors] = scripted._scripted_processors
    log: list[Exchange] = []
    app.add_middleware(_Recorder, log=log)
    with serve_app(app) as server:
        if not engine.wait_ready(120):
            raise RuntimeError(f"model failed to load: {engine.load_error}")
        yield server, log


def context_length(server: Server) -> int:
    return server.http().get("/v1/models").json()["data"][0]["context_length"]


def images_encoded(server: Server) -> float:
    """Images the server's vision tower has encoded: an image that reached the model."""
    return metric(server.http().get("/metrics").text, "flashserve_images_encoded_total") or 0.0
