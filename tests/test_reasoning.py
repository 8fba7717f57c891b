"""Reasoning: `<think>...</think>` goes to reasoning_content, not content.

Real servers on loopback (in this process, so the tiny model's output can be
scripted, see tests/scripted.py) with the real Qwen3 chat template; the
official openai SDK as the client.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flashserve.server.chat.output_parser import OutputParser
from flashserve.server.chat.reasoning import THINK, ReasoningMarkers, resolve_markers

from .conftest import Server
from .scripted import FIXTURES, make_templated_model, script, scripted_server

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "\nThe user wants a sum. 2 + 2 = 4.\n"
REPLY = f"<think>{THOUGHT}</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_templated_model(tmp_path_factory.mktemp("reasoning") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Iterator[Server]:
    with scripted_server(qwen3_dir) as server:
        yield server


def ask(server: Server, text: str, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.model_id, messages=ASK, temperature=0, max_tokens=64, **script(text), **kwargs
    )


def streamed(server: Server, text: str) -> tuple[str, str, list[Any]]:
    chunks = list(ask(server, text, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning, content, chunks


def test_reasoning_is_split_from_content(qwen3: Server) -> None:
    message = ask(qwen3, REPLY).choices[0].message
    assert message.content == "The answer is 4."
    assert getattr(message, "reasoning_content", None) == THOUGHT
    reasoning, content, chunks = streamed(qwen3, REPLY)
    assert (reasoning, content) == (THOUGHT, "The answer is 4.")
    assert not any("<think>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_reply_without_reasoning_has_no_reasoning_content(qwen3: Server) -> None:
    message = ask(qwen3, "Four.").choices[0].message
    assert message.content == "Four."
    assert getattr(message, "reasoning_content", None) is None


def test_reasoning_before_a_tool_call(qwen3: Server) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
            },
        }
    ]
    text = (
        "<think>I will add.</think>\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    )
    response = ask(qwen3, text, tools=tools)
    message = response.choices[0].message
    assert getattr(message, "reasoning_content", None) == "I will add."
    assert message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("add", '{"a": 2, "b": 2}')
    ]
    assert response.choices[0].finish_reason == "tool_calls"


def test_reasoning_parser_none_keeps_the_markers(qwen3_dir: Path) -> None:
    with scripted_server(qwen3_dir, reasoning_parser="none") as server:
        message = ask(server, REPLY).choices[0].message
        assert message.content == REPLY
        assert getattr(message, "reasoning_content", None) is None
        reasoning, content, _ = streamed(server, REPLY)
        assert (reasoning, content) == ("", REPLY)


def test_template_that_opens_the_reasoning_block(tmp_path: Path) -> None:
    """DeepSeek-R1 / Qwen3.5-style templates end the prompt with `<think>`:
    the reply starts mid-thought and only `</think>` appears in it."""
    from flashserve.engine.weights.synthetic import make_model_dir

    template = (
        (FIXTURES / "qwen3.jinja")
        .read_text()
        .replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    )
    assert "assistant\\n<think>" in template
    path = make_model_dir(tmp_path / "opens-think", "llama", chat_template=template)
    with scripted_server(path) as server:
        message = ask(server, "Two and two.</think>Four.").choices[0].message
        assert (message.reasoning_content, message.content) == ("Two and two.", "Four.")
        reasoning, content, _ = streamed(server, "Two and two.</think>Four.")
        assert (reasoning, content) == ("Two and two.", "Four.")


# -- the parser and the markers, without a server ------------------------------------------


def test_markers_from_the_tokenizer_and_the_setting(qwen3_dir: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(qwen3_dir)
    assert resolve_markers(tokenizer, None) == THINK
    assert resolve_markers(tokenizer, "auto") == THINK
    assert resolve_markers(tokenizer, "none") is None
    assert resolve_markers(tokenizer, "think") == THINK
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        resolve_markers(tokenizer, "telepathy")


def test_prompt_opens_reasoning() -> None:
    assert THINK.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not THINK.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.prompt_opens_reasoning("<|im_start|>assistant\n")


@pytest.mark.parametrize("size", [1, 2, 4, 100])
def test_split_markers_and_custom_markers(size: int) -> None:
    markers = ReasoningMarkers("<|think:start|>", "<|think:end|>")
    text = "  <|think:start|>plan<|think:end|>\n\nanswer <|think:start|> stays"
    parser = OutputParser(reasoning=markers)
    for i in range(0, len(text), size):
        parser.feed(text[i : i + size])
    parser.finish()
    assert parser.reasoning_text == "plan"
    assert parser.content == "answer <|think:start|> stays"


def test_unclosed_reasoning_stays_reasoning() -> None:
    parser = OutputParser(reasoning=THINK)
    parser.feed("<think>still going")
    parser.finish()
    assert (parser.reasoning_text, parser.content) == ("still going", "")
    plain = OutputParser(reasoning=THINK)
    plain.feed("<thin")
    plain.feed("g> is not a marker")
    plain.finish()
    assert plain.content == "<thing> is not a marker"


def test_constraint_waits_for_an_opened_reasoning_block_to_close(qwen3_dir: Path) -> None:
    """With the prompt inside `<think>`, tool_choice / response_format constraints
    start after `</think>`; the model's padded logits past the vocabulary stay banned."""
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from flashserve.engine.generation.constraints import GrammarProcessor, compile_grammar
    from flashserve.server.chat.structured import response_format_grammar

    tokenizer = load_tokenizer(qwen3_dir)
    grammar = compile_grammar(tokenizer, response_format_grammar({"type": "object"}).text())
    end = tokenizer.encode("</think>", add_special_tokens=False)
    processor = GrammarProcessor(tokenizer, grammar, after=end)
    vocab = len(tokenizer) + 64  # models pad their output layer
    logits = mx.zeros((1, vocab))
    prompt = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    thought = tokenizer.encode("hmm, braces? no", add_special_tokens=False)
    tokens = list(prompt)
    for token in [None, *thought]:  # free while thinking: nothing is masked
        if token is not None:
            tokens.append(token)
        assert mx.all(processor(mx.array(tokens), logits) == 0).item()
    tokens += end
    allowed = processor(mx.array(tokens), logits)[0].tolist()
    opening = [i for i, v in enumerate(allowed) if v == 0]
    assert opening and all(tokenizer.decode([i]).startswith("{") for i in opening)
    assert all(v == float("-inf") for v in allowed[len(tokenizer) :])
