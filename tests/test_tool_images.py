"""An image in a tool's output reaches a text-only model as a placeholder, in every dialect.

Agents' tools put images there on their own (Claude Code's Read of a PNG,
Codex's view_image), and a 400 ends an agent's session. So an image inside an
Anthropic `tool_result`, a Chat Completions tool message or a Responses
`function_call_output` becomes the text PLACEHOLDER, logged once per place;
an image in the user's own message is still a 400 in the route's dialect.

What the model read is seen from outside: with greedy decoding the answer is
a function of the prompt, so the request with the image and the same request
with PLACEHOLDER written as text count the same prompt tokens and say the
same thing. The servers are real (`flashserve serve`), the clients the
official SDKs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from .conftest import NO_EOS, Server, start_server, stop_server

PLACEHOLDER = "[image omitted: this model accepts text only]"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
DATA_URL = f"data:image/png;base64,{PNG}"
LOGGED = "replaced by a placeholder"
OUT = 12  # greedy tokens compared


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tiny_llama_dir, tmp_path_factory.mktemp("tool-images"))
    yield running
    stop_server(running)


def logged(server: Server, where: str) -> int:
    """How many times the server logged an image it replaced at `where`."""
    lines = server.log_tail(10**7).splitlines()
    return sum(1 for line in lines if LOGGED in line and where in line)


# -- Anthropic Messages --------------------------------------------------------------


def anthropic_turn(result: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Claude Code's shape: Read called, its result (a PNG) in a tool_result."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "shot.png"}}
    return [
        {"role": "user", "content": "What is in shot.png?"},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": result}]},
    ]  # fmt: skip


def test_anthropic_tool_result_image_is_a_placeholder(server: Server) -> None:
    sdk = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0, timeout=120.0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    header = {"type": "text", "text": "Read 1 image."}

    def ask(result: list[dict[str, Any]]) -> Any:
        return sdk.messages.create(
            model=server.model_id,
            max_tokens=OUT,
            messages=anthropic_turn(result),
            extra_body={"temperature": 0},  # SDK 2.x has no temperature argument
        )

    seen = ask([header, image])
    again = ask([header, image])
    written = ask([header, {"type": "text", "text": PLACEHOLDER}])
    other = ask([header, {"type": "text", "text": "[image]"}])
    assert seen.usage.input_tokens == written.usage.input_tokens != other.usage.input_tokens
    assert seen.content == written.content == again.content
    assert logged(server, "tool_result") == 1
    # A document (Read of a PDF) the same way.
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": "JVBERi0="}}  # fmt: skip
    assert ask([pdf]).stop_reason in ("end_turn", "max_tokens")
    # The user's own image is still refused, in Anthropic's shape.
    with pytest.raises(anthropic.BadRequestError) as refused:
        sdk.messages.create(
            model=server.model_id,
            max_tokens=OUT,
            messages=[{"role": "user", "content": [header, image]}],
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "this model accepts text only" in refused.value.body["error"]["message"]


# -- Chat Completions ----------------------------------------------------------------


def chat_turn(result: list[dict[str, Any]]) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "view_image", "arguments": '{"path": "shot.png"}'}}  # fmt: skip
    return [
        {"role": "user", "content": "What is in shot.png?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def test_chat_tool_message_image_is_a_placeholder(server: Server) -> None:
    client = server.client()
    image = {"type": "image_url", "image_url": {"url": DATA_URL}}
    header = {"type": "text", "text": "Read 1 image."}

    def ask(result: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(
            model=server.model_id,
            messages=chat_turn(result),  # type: ignore[arg-type]
            max_tokens=OUT,
            temperature=0,
            logit_bias=NO_EOS,
        )

    seen, again = ask([header, image]), ask([image, header])
    written = ask([header, {"type": "text", "text": PLACEHOLDER}])
    assert seen.usage and written.usage and again.usage
    assert seen.usage.prompt_tokens == written.usage.prompt_tokens == again.usage.prompt_tokens
    assert seen.choices[0].message.content == written.choices[0].message.content
    assert logged(server, "a tool message") == 1
    # Only text and images in a tool message; the user's own image is still a 400.
    with pytest.raises(openai.BadRequestError) as audio:
        ask([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
    assert "input_audio" in str(audio.value.body)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": [header, image]}]
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "messages.0.content.1"
    assert "accepts text only" in refused.value.body["message"]


# -- Responses -----------------------------------------------------------------------


def responses_turn(output: list[dict[str, Any]]) -> list[Any]:
    """Codex's shape: view_image called, its output an input_image."""
    return [
        {"role": "user", "content": "What is in shot.png?"},
        {"type": "function_call", "call_id": "call_1", "name": "view_image",
         "arguments": '{"path": "shot.png"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": output},
    ]  # fmt: skip


def test_responses_function_call_output_image_is_a_placeholder(server: Server) -> None:
    client = server.client()
    image = {"type": "input_image", "image_url": DATA_URL, "detail": "high"}

    def ask(output: list[dict[str, Any]], **kwargs: Any) -> Any:
        return client.responses.create(
            model=server.model_id,
            input=responses_turn(output),  # type: ignore[arg-type]
            max_output_tokens=OUT,
            temperature=0,
            **kwargs,
        )

    seen = ask([image])
    written = ask([{"type": "input_text", "text": PLACEHOLDER}])
    assert seen.usage and written.usage
    assert seen.usage.input_tokens == written.usage.input_tokens
    assert seen.output_text == written.output_text
    # Streamed, and continued from the stored response: the image is read the same way.
    events = list(ask([image], stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    follow = client.responses.create(
        model=server.model_id, previous_response_id=seen.id, input="Go on.", max_output_tokens=2
    )
    assert follow.status in ("completed", "incomplete")
    assert logged(server, "function_call_output") == 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=server.model_id,
            input=[{"role": "user", "content": [image]}],  # type: ignore[list-item]
        )
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["param"] == "input[0].content[0].type"
