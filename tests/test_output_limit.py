"""A request that sets no output limit runs until the model stops or the context is full.

OpenAI's APIs and llama.cpp's server read a missing (or null) `max_tokens` /
`max_output_tokens` as "no limit but the context"; Codex CLI sends
`max_output_tokens: null` on every request and fails its turn on an
`incomplete` response. The model here has a context of 2560 tokens, above the
2048 that used to be the server's default, so an answer cut at a fixed
default shows: the scripted model (tests/scripted.py) says a text longer
than the old default and must say all of it, and a text longer than the
context must run exactly to the context's end. `default_max_tokens`, when a
server sets it, still caps such requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .agent_servers import ONE_LAYER, make_agent_model
from .conftest import NO_EOS, Server
from .scripted import script, script_queue, scripted_server

CONTEXT = 2560
OLD_DEFAULT = 2048
LONGER_THAN_CONTEXT = "lorem ipsum " * 400  # ~4800 of the tiny tokenizer's tokens
CAP = 100
USER = [{"role": "user", "content": "Write at length."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_agent_model(tmp_path_factory.mktemp("limit") / "tiny", CONTEXT, **ONE_LAYER)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    with scripted_server(model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def past_old_default(model_dir: Path) -> str:
    """A text of more tokens than the old default, fewer than the context leaves."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    words = 200
    while True:
        text = " ".join(["dolor sit amet"] * words)
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        if tokens > OLD_DEFAULT + 20:
            assert tokens < CONTEXT - 100, tokens
            return text
        words += 10


def test_chat_without_a_limit_runs_to_the_end_of_the_context(
    server: Server, past_old_default: str
) -> None:
    client = server.client()
    for limit in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        answer = client.chat.completions.create(
            model=server.model_id, messages=USER, **limit, **script(LONGER_THAN_CONTEXT)
        )
        used = answer.usage
        assert used is not None
        assert used.prompt_tokens + used.completion_tokens == CONTEXT, (limit, used)
        assert answer.choices[0].finish_reason == "length", limit
    # An answer longer than the old default, shorter than the context: said whole.
    whole = client.chat.completions.create(
        model=server.model_id, messages=USER, **script(past_old_default)
    )
    assert whole.choices[0].message.content == past_old_default
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens > OLD_DEFAULT


def test_completions_without_a_limit_run_to_the_end_of_the_context(server: Server) -> None:
    client = server.client()
    for limit in ({}, {"max_tokens": None}):
        answer = client.completions.create(
            model=server.model_id, prompt="Once upon a time", logit_bias=NO_EOS, **limit
        )
        assert answer.usage is not None and answer.usage.total_tokens == CONTEXT, answer.usage
        assert answer.choices[0].finish_reason == "length"


def test_responses_with_null_max_output_tokens_complete(
    server: Server, past_old_default: str
) -> None:
    """Codex's request: `max_output_tokens: null`, streamed."""
    text = past_old_default
    queue = script_queue(text, text, LONGER_THAN_CONTEXT)
    client = server.client(default_headers=queue.headers)
    done = client.responses.create(model=server.model_id, input="Go.", max_output_tokens=None)
    assert done.status == "completed" and done.output_text == text
    assert done.usage is not None and done.usage.output_tokens > OLD_DEFAULT
    events: list[Any] = list(
        client.responses.create(
            model=server.model_id, input="Go.", max_output_tokens=None, stream=True
        )
    )
    assert events[-1].type == "response.completed", events[-1]
    assert events[-1].response.output_text == text
    full = client.responses.create(model=server.model_id, input="Go.")
    assert full.status == "incomplete"
    assert full.incomplete_details is not None
    assert full.incomplete_details.reason == "max_output_tokens"
    assert full.usage is not None
    assert full.usage.input_tokens + full.usage.output_tokens == CONTEXT
    # The SDK did send the nulls (and nothing for the last request).
    assert [body.get("max_output_tokens", "absent") for body in queue.bodies] == [
        None,
        None,
        "absent",
    ]


def test_default_max_tokens_when_set_caps_requests_without_a_limit(model_dir: Path) -> None:
    with scripted_server(model_dir, default_max_tokens=CAP) as capped:
        client = capped.client()
        answer = client.chat.completions.create(
            model=capped.model_id, messages=USER, max_tokens=None, **script(LONGER_THAN_CONTEXT)
        )
        assert answer.usage is not None and answer.usage.completion_tokens == CAP
        assert answer.choices[0].finish_reason == "length"
        # An explicit limit is the request's own, above the cap too.
        wider = client.chat.completions.create(
            model=capped.model_id, messages=USER, max_tokens=2 * CAP, **script(LONGER_THAN_CONTEXT)
        )
        assert wider.usage is not None and wider.usage.completion_tokens == 2 * CAP
        response = client.responses.create(
            model=capped.model_id, input="Go.", **script(LONGER_THAN_CONTEXT)
        )
        assert response.status == "incomplete"
        assert response.usage is not None and response.usage.output_tokens == CAP
        completion = client.completions.create(
            model=capped.model_id, prompt="Once upon a time", logit_bias=NO_EOS
        )
        assert completion.usage is not None and completion.usage.completion_tokens == CAP
