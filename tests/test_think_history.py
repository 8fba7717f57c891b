"""The next turn reuses the prompt + answer of the last one with Qwen3's template.

Qwen3's chat template ends a thinking-off generation prompt with an empty
`<think>\\n\\n</think>\\n\\n` block and renders earlier assistant turns without
it (and without their reasoning): the next turn's tokens leave the stored
prompt + answer at that block. `history_thinking` (server/chat/think_history.py)
shows the turn as the model saw it. A tiny qwen3 model (mlx-lm's architecture)
with Qwen3's real template, scripted where its answer must be a given text
(tests/scripted.py), on real servers in this process; the openai and anthropic
SDKs as clients. A second turn that reuses the first one's answer is greedy and
must equal a cold server's (no prompt cache) for the same request, token for
token. (A scripted answer's forward pass runs lazily, when its stored state is
first used: the scripted logits do not depend on the model's.)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flashserve.engine.weights.synthetic import make_model_dir

from .conftest import Server
from .scripted import FIXTURES, script, scripted_server

QWEN3 = (FIXTURES / "qwen3.jinja").read_text()
# Qwen3.5's variant: a turn after the last user query always shows its block.
QWEN35_BRANCH = "{%- if loop.last or (not loop.last and reasoning_content) %}"
QWEN35 = QWEN3.replace(QWEN35_BRANCH, "{%- if true %}")
CACHE = {"prompt_cache_bytes": 64_000_000}
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
ANSWER = "The capital of France is Paris."
THOUGHT = "The user asks about France."
NEXT = {"role": "user", "content": "And how is the weather today?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("think") / "qwen3", "qwen3", chat_template=QWEN3)


@pytest.fixture(scope="module")
def cold(qwen3_dir: Path) -> Iterator[Server]:
    """No prompt cache: every prompt prefilled from token 0."""
    with scripted_server(qwen3_dir, history_thinking="keep") as server:
        yield server


@pytest.fixture(scope="module")
def warm(qwen3_dir: Path) -> Iterator[Server]:
    """The prompt cache on, history_thinking at its default."""
    with scripted_server(qwen3_dir, **CACHE) as server:
        yield server


@functools.cache
def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def tokens(model: Path, text: str) -> list[int]:
    return _tokenizer(model).encode(text, add_special_tokens=False)


def chat(server: Server, messages: list[dict], reply: str | None = None, **kwargs: Any) -> Any:
    """One turn: scripted to `reply`, else greedy."""
    extra = script(reply) if reply is not None else {}
    return server.client().chat.completions.create(
        model=server.model_id,
        messages=messages,
        temperature=0,
        max_tokens=48 if reply is not None else 12,
        logprobs=reply is None,
        **extra,
        **kwargs,
    )


def greedy(response: Any) -> list[str]:
    return [t.token for t in response.choices[0].logprobs.content]


def second_turn(server: Server, cold: Server, messages: list[dict], **kwargs: Any) -> Any:
    """The greedy next turn on `server`, checked token for token against a cold server's."""
    response = chat(server, messages, **kwargs)
    reference = chat(cold, messages, **kwargs)
    assert greedy(response) == greedy(reference) and greedy(response)
    assert response.usage.prompt_tokens == reference.usage.prompt_tokens
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    return response


def test_thinking_off_next_turn_reuses_prompt_and_answer(
    warm: Server, cold: Server, qwen3_dir: Path
) -> None:
    first = chat(warm, ASK, ANSWER, extra_body=OFF)
    assert first.choices[0].message.content == ANSWER
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    second = second_turn(warm, cold, [*ASK, answer, NEXT], extra_body=OFF)
    # The whole first prompt, the answer and its <|im_end|>: all but the new turn.
    reused = first.usage.prompt_tokens + len(tokens(qwen3_dir, ANSWER)) + 1
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    assert first.usage.completion_tokens == len(tokens(qwen3_dir, ANSWER))  # <|im_end|> not counted


def test_thinking_off_tool_loop_reuses_prompt_and_call(
    warm: Server, cold: Server, qwen3_dir: Path
) -> None:
    first = chat(warm, ASK, CALL, extra_body=OFF, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    assert (call.function.name, first.choices[0].message.content) == ("get_weather", None)
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}
    second = second_turn(warm, cold, [*ASK, turn, result], extra_body=OFF, tools=TOOLS)
    reused = first.usage.prompt_tokens + len(tokens(qwen3_dir, CALL)) + 1
    assert second.usage.prompt_tokens_details.cached_tokens == reused


def test_template_setting_keeps_the_canonical_prompt(qwen3_dir: Path) -> None:
    """history_thinking = template: the block is dropped, reuse stops before it."""
    with scripted_server(qwen3_dir, history_thinking="template", **CACHE) as server:
        first = chat(server, ASK, ANSWER, extra_body=OFF)
        answer = {"role": "assistant", "content": ANSWER}
        second = chat(server, [*ASK, answer, NEXT], extra_body=OFF)
    block = len(tokens(qwen3_dir, "<think>\n\n</think>\n\n"))
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - block


def test_thinking_on_keep_reuses_prompt_reasoning_and_answer(qwen3_dir: Path, cold: Server) -> None:
    reply = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    with scripted_server(qwen3_dir, history_thinking="keep", **CACHE) as server:
        first = chat(server, ASK, reply)
        message = first.choices[0].message
        assert (message.content, message.reasoning_content.strip()) == (ANSWER, THOUGHT)
        answer = {
            "role": "assistant",
            "content": message.content,
            "reasoning_content": message.reasoning_content,
        }
        second = second_turn(server, cold, [*ASK, answer, NEXT])
    reused = first.usage.prompt_tokens + len(tokens(qwen3_dir, reply)) + 1
    assert second.usage.prompt_tokens_details.cached_tokens == reused


def test_thinking_on_default_drops_reasoning_as_the_template_does(
    warm: Server, qwen3_dir: Path
) -> None:
    """The default shows no reasoning text the template would drop: the prompt is
    the canonical one, and reuse ends where the stored answer's reasoning began."""
    reply = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    first = chat(warm, ASK, reply)
    message = first.choices[0].message
    answer = {
        "role": "assistant",
        "content": message.content,
        "reasoning_content": message.reasoning_content,
    }
    second = chat(warm, [*ASK, answer, NEXT])
    canonical = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        f"<|im_start|>assistant\n{ANSWER}<|im_end|>\n"
        f"<|im_start|>user\n{NEXT['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert second.usage.prompt_tokens == len(tokens(qwen3_dir, canonical))
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens


def test_a_template_that_shows_the_block_itself_gets_no_second_one(
    tmp_path: Path,
) -> None:
    """Qwen3.5's template keeps the block of a turn after the last user query (a tool
    loop): the probe render sees it, and no block is added to the content."""
    model = make_model_dir(tmp_path / "qwen35", "qwen3", chat_template=QWEN35)
    with scripted_server(model, **CACHE) as server:
        first = chat(server, ASK, CALL, extra_body=OFF, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
        result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}
        second = chat(server, [*ASK, turn, result], extra_body=OFF, tools=TOOLS)
    reused = first.usage.prompt_tokens + len(tokens(model, CALL)) + 1
    assert second.usage.prompt_tokens_details.cached_tokens == reused


def test_anthropic_thinking_disabled_next_turn_reuses_prompt_and_answer(
    warm: Server, qwen3_dir: Path
) -> None:
    """Messages API, thinking disabled (Claude Code's default): the same reuse."""
    import anthropic

    sdk = anthropic.Anthropic(base_url=warm.url, api_key="unused", max_retries=0, timeout=120.0)
    body = {"temperature": 0, "thinking": {"type": "disabled"}}
    question = [{"role": "user", "content": "Where is the Eiffel Tower?"}]
    first = sdk.messages.create(
        model=warm.model_id, max_tokens=48, messages=question, extra_body=body, **script(ANSWER)
    )
    assert first.content[0].text == ANSWER
    history = [*question, {"role": "assistant", "content": ANSWER}, NEXT]
    second = sdk.messages.create(
        model=warm.model_id, max_tokens=4, messages=history, extra_body=body
    )
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    reused = prompt + len(tokens(qwen3_dir, ANSWER)) + 1
    assert second.usage.cache_read_input_tokens == reused


def test_hybrid_model_reuses_prompt_and_answer(tmp_path: Path) -> None:
    """qwen3_next's recurrent state cannot be trimmed: a stored state serves only
    a prompt it is a whole prefix of. With the block dropped, neither the prompt's
    state nor the answer's is one; with it kept, the answer's is."""
    model = make_model_dir(tmp_path / "qwen3_next", "qwen3_next", chat_template=QWEN3)
    answer = {"role": "assistant", "content": ANSWER}
    with scripted_server(model, history_thinking="keep") as cold:
        for setting, covers_answer in (("template", False), ("empty", True)):
            with scripted_server(model, history_thinking=setting, **CACHE) as server:
                first = chat(server, ASK, ANSWER, extra_body=OFF)
                turn = [*ASK, answer, NEXT]
                if covers_answer:
                    second = second_turn(server, cold, turn, extra_body=OFF)
                    reused = first.usage.prompt_tokens + len(tokens(model, ANSWER)) + 1
                else:
                    second, reused = chat(server, turn, extra_body=OFF), 0
            assert second.usage.prompt_tokens_details.cached_tokens == reused, setting
