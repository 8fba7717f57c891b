"""Streamed events survive every client's line reader (CI failure of stop 49).

SSE ends lines only at CR and LF, but httpx's `iter_lines` and Python's
`str.splitlines` also split at U+2028, U+2029 and U+0085. A random model's
token decoded to one of them and cut a chunk in two; the server now writes them
as JSON escapes. Text that carries them is echoed back here (a completion's
echo, a response's instructions), read with `iter_lines`, and must come back
whole.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai

from flashserve.server.http.sse import escape_line_breaks

from .conftest import Server

BREAKS = "a\u2028b\u2029c\x85d"


def data_lines(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.read()
    return [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]


def test_escaping_keeps_the_json_value() -> None:
    document = json.dumps({"text": BREAKS}, ensure_ascii=False)
    escaped = escape_line_breaks(document)
    assert len(escaped.splitlines()) == 1 and len(document.splitlines()) == 4
    assert json.loads(escaped) == {"text": BREAKS}


def test_completion_echo_with_line_breaks_streams_one_line_per_event(
    llama_server: Server,
) -> None:
    body = {
        "model": "tiny-llama",
        "prompt": BREAKS,
        "echo": True,
        "max_tokens": 2,
        "temperature": 0,
    }
    with llama_server.http().stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        lines = data_lines(r)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["text"] == BREAKS
    whole = llama_server.http().post("/v1/completions", json=body).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_responses_instructions_with_line_breaks_stream_whole(llama_server: Server) -> None:
    body: dict[str, Any] = {
        "model": "tiny-llama",
        "input": "hi",
        "instructions": BREAKS,
        "max_output_tokens": 2,
        "stream": True,
    }
    with llama_server.http().stream("POST", "/v1/responses", json=body) as r:
        events = [json.loads(line) for line in data_lines(r)]
    created = next(e for e in events if e["type"] == "response.created")
    assert created["response"]["instructions"] == BREAKS
    # The official SDK reads the same stream.
    client: openai.OpenAI = llama_server.client()
    body.pop("stream")
    streamed = list(client.responses.create(stream=True, **body))
    assert streamed[0].response.instructions == BREAKS
