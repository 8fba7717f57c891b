"""The server on other models: a tiny MoE (qwen3_moe) and the bundled default
(SmolLM2-135M-Instruct GGUF), each served by `flashserve serve` in a subprocess."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from flashserve.engine.weights.sources import default_model_path

from .conftest import NO_EOS, Server, start_server, stop_server


@pytest.fixture(scope="module")
def moe_server(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_moe_dir, tmp_path_factory.mktemp("moe-server"))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    default_model_path()  # the README's test command installs it: missing is a failure
    # No --model: the server picks the bundled default itself.
    server = start_server(None, tmp_path_factory.mktemp("default-server"))
    yield server
    stop_server(server)


def test_moe_model_streams_and_answers(moe_server: Server) -> None:
    client = moe_server.client()
    model = moe_server.model_id
    assert model == "tiny-qwen3-moe"
    kwargs = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "temperature": 0,
        "max_tokens": 12,
        "logit_bias": NO_EOS,
    }
    whole = client.chat.completions.create(**kwargs)
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content


def test_default_model_knows_the_capital_of_france(default_server: Server) -> None:
    client = default_server.client()
    response = client.chat.completions.create(
        model=default_server.model_id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=40,
    )
    answer = response.choices[0].message.content
    assert "Paris" in answer, answer
    assert response.choices[0].finish_reason in ("stop", "length")


def test_default_model_refuses_suffix_naming_the_missing_fim_tokens(
    default_server: Server,
) -> None:
    """SmolLM2 has no fill-in-the-middle tokens: `suffix` is a 400 that says so."""
    with pytest.raises(openai.BadRequestError) as err:
        default_server.client().completions.create(
            model=default_server.model_id, prompt="def f(", suffix="):\n", max_tokens=4
        )
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "suffix"
    assert "fim" in body["message"].lower(), body


def test_default_model_completion_keeps_its_first_space(default_server: Server) -> None:
    """A completion continues the prompt's text: the space before the next word is the
    completion's (mlx-lm's streaming detokenizer drops it at the start of a text)."""
    client = default_server.client()
    kwargs = {"model": default_server.model_id, "prompt": "The capital of France is"}
    whole = client.completions.create(max_tokens=3, temperature=0, **kwargs)
    text = whole.choices[0].text
    assert text.startswith(" "), repr(text)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(max_tokens=3, temperature=0, stream=True, **kwargs)
        if c.choices
    )
    assert streamed == text
