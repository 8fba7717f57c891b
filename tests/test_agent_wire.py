"""What coding agents need of the wire, beyond each dialect's own tests.

- System messages inside the conversation (Claude Code's agent list and task
  notifications): a system turn where they stand for templates that take one,
  folded into user turns for templates that refuse or drop them.
- The context limit in each dialect's own words (Claude Code compacts only on
  Anthropic's); GET and HEAD / answer (Claude Code's warm-up probe).
- message_start's usage splits cached input as the final usage does.

Real servers on loopback with tiny models carrying real chat templates; the
official anthropic and openai SDKs and httpx.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from flashserve.engine.weights.synthetic import build_tokenizer
from flashserve.server.chat.prompts import render_prompt

from .conftest import Server
from .scripted import FIXTURES, MISTRAL_TOKENS, make_templated_model, scripted_server

KEY = "wire-key"
NOTE = "Background task 7 finished: exit code 0."
AGENTS = "Available agent types: general-purpose, explore."
# A template that takes a system message only first and silently drops any other.
FIRST_ONLY = (
    "{% if messages[0].role == 'system' %}SYSTEM: {{ messages[0].content }}\n{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}: {{ m.content }}\n"
    "{% endif %}{% endfor %}assistant:"
)


def conversation(trailing: bool) -> list[dict[str, Any]]:
    out = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files."},
        {"role": "system", "content": AGENTS},
        {"role": "assistant", "content": "There are two files."},
        {"role": "user", "content": "Run the tests in the background."},
        {"role": "assistant", "content": "Started."},
    ]
    if trailing:
        out.append({"role": "system", "content": NOTE})
    else:
        out += [{"role": "system", "content": NOTE}, {"role": "user", "content": "Go on."}]
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("system-turns")
    build_tokenizer(root / "qwen3", chat_template=(FIXTURES / "qwen3.jinja").read_text())
    build_tokenizer(
        root / "mistral",
        chat_template=(FIXTURES / "mistral_v03.jinja").read_text(),
        extra_special_tokens=MISTRAL_TOKENS,
        bos_token="<s>",
        eos_token="</s>",
    )
    build_tokenizer(root / "first-only", chat_template=FIRST_ONLY)
    return {name: load_tokenizer(root / name) for name in ("qwen3", "mistral", "first-only")}


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    text, _ = asyncio.run(render_prompt(tokenizer, messages, None))
    return text


@pytest.mark.parametrize("trailing", [False, True])
def test_system_turns_where_the_template_takes_them(tokenizers: dict, trailing: bool) -> None:
    text = render(tokenizers["qwen3"], conversation(trailing))
    assert f"<|im_start|>system\n{AGENTS}<|im_end|>\n<|im_start|>assistant" in text
    assert f"<|im_start|>system\n{NOTE}<|im_end|>" in text
    # A trailing system message still gets the generation prompt after it.
    assert text.endswith("<|im_start|>assistant\n") or text.rstrip().endswith("</think>")
    assert text.index(NOTE) > text.index("Started.")


@pytest.mark.parametrize("template", ["mistral", "first-only"])
@pytest.mark.parametrize("trailing", [False, True])
def test_system_turns_folded_where_the_template_refuses_or_drops_them(
    tokenizers: dict, template: str, trailing: bool
) -> None:
    text = render(tokenizers[template], conversation(trailing))
    # Every system text reaches the model, in order, inside a user turn.
    assert AGENTS in text and NOTE in text
    assert text.index("List the files.") < text.index(AGENTS) < text.index("two files")
    assert text.index("Started.") < text.index(NOTE)
    assert f"List the files.\n\n{AGENTS}" in text  # appended to the user turn before it
    if template == "first-only":
        assert f"user: {NOTE}" in text  # before "Go on.", or a user turn of its own
        assert text.endswith("assistant:")
    else:
        assert text.count("[INST]") == 3 and text.rstrip().endswith("[/INST]")


# -- against a server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = make_templated_model(tmp_path_factory.mktemp("wire") / "tiny-qwen3", "qwen3")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(config))
    with scripted_server(path, api_key=KEY, prompt_cache_bytes=100_000_000) as running:
        yield running


def sdk(server: Server) -> anthropic.Anthropic:
    made = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120.0)
    server._clients.append(made)
    return made


def anthropic_messages(trailing: bool) -> list[dict[str, Any]]:
    # Anthropic's shape: the first system message is the `system` field.
    out = conversation(trailing)[1:]
    out[1] = {"role": "system", "content": [{"type": "text", "text": AGENTS}]}
    return out


@pytest.mark.parametrize("trailing", [False, True])
def test_messages_take_system_messages_anywhere(server: Server, trailing: bool) -> None:
    client = sdk(server)
    body = {
        "model": server.model_id,
        "system": "You are a coding agent.",
        "messages": anthropic_messages(trailing),
        "max_tokens": 4,
        "extra_headers": {"anthropic-beta": "mid-conversation-system-2026-04-07"},
    }
    message = client.messages.create(**body)
    assert message.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(
        model=server.model_id, system=body["system"], messages=body["messages"]
    )
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0
    )
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_prompt_too_long_in_each_dialects_words(server: Server) -> None:
    words = " ".join(["tokens"] * 1500)
    with pytest.raises(anthropic.BadRequestError) as refused:
        sdk(server).messages.create(
            model=server.model_id, max_tokens=8, messages=[{"role": "user", "content": words}]
        )
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error"
    # Claude Code matches this wording to start compacting the conversation.
    words_matched = re.fullmatch(
        r"prompt is too long: (\d+) tokens > (\d+) maximum", error["message"]
    )
    assert words_matched is not None, error["message"]
    assert int(words_matched[1]) > int(words_matched[2]) == 1023
    openai_route = server.http(headers={"Authorization": f"Bearer {KEY}"}).post(
        "/v1/chat/completions",
        json={"model": server.model_id, "messages": [{"role": "user", "content": words}]},
    )
    assert openai_route.status_code == 400
    assert openai_route.json()["error"]["code"] == "context_length_exceeded"


def test_root_answers_get_and_head_without_a_key(server: Server) -> None:
    got = httpx.get(server.url + "/", timeout=30)
    assert got.status_code == 200
    assert got.json()["name"] == "flashserve" and got.json()["model"] == server.model_id
    head = httpx.head(server.url + "/", timeout=30)
    assert head.status_code == 200 and head.content == b""
    # Everything else still needs the key.
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_message_start_usage_splits_cached_input_as_the_final_usage(server: Server) -> None:
    body = {
        "model": server.model_id,
        "max_tokens": 3,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Summarize the repository layout. " * 20}],
    }
    http = server.http(headers={"x-api-key": KEY})
    for turn in range(2):
        with http.stream("POST", "/v1/messages", json=body) as response:
            assert response.status_code == 200
            events = sse_events(response)
        start = events[0]["message"]["usage"]
        final = next(e for e in events if e["type"] == "message_delta")["usage"]
        assert start["input_tokens"] == final["input_tokens"], turn
        assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"], turn
    # The second turn found the first's prompt in the prompt cache.
    assert final["cache_read_input_tokens"] > 0


def test_unknown_role_is_still_refused_in_anthropic_shape(server: Server) -> None:
    refused = server.http(headers={"x-api-key": KEY}).post(
        "/v1/messages",
        json={
            "model": server.model_id,
            "max_tokens": 4,
            "messages": [{"role": "developer", "content": "hi"}],
        },
    )
    assert refused.status_code == 400
    assert refused.json()["type"] == "error" and "messages.0" in refused.json()["error"]["message"]


def test_fields_and_betas_not_acted_on_are_logged_once(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    body = {
        "model": server.model_id,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "context_management_wire_test": {"edits": []},
    }
    betas = "wire-test-beta-2026-01-01, mid-conversation-system-2026-04-07"
    http = server.http(headers={"x-api-key": KEY, "anthropic-beta": betas})
    with caplog.at_level("INFO", logger="flashserve.server.http.ignored"):
        for _ in range(2):
            assert http.post("/v1/messages", json=body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "flashserve.server.http.ignored"]
    assert (
        lines.count(
            "ConversationFields: field 'context_management_wire_test' accepted and not acted on"
        )
        + lines.count(
            "MessagesRequest: field 'context_management_wire_test' accepted and not acted on"
        )
        == 1
    ), lines
    assert (
        lines.count("anthropic-beta: flag 'wire-test-beta-2026-01-01' accepted and not acted on")
        == 1
    )
    assert not any("mid-conversation-system" in line for line in lines)
