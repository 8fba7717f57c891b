"""The sandboxed renderer (server/chat/sandbox.py) renders model chat templates as
transformers' apply_chat_template does, and tokenizes as tokenizer.encode does.

The server renders every Jinja chat template itself (within time and size
limits) instead of calling apply_chat_template. These tests hold it to the
same text and the same token ids, on real model families' templates
(tests/fixtures), through mlx-lm's tokenizer wrapper as the server loads it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from flashserve.engine.weights.synthetic import CHATML_TEMPLATE, build_tokenizer
from flashserve.server.chat.conversation import PromptLimits
from flashserve.server.chat.prompts import encode, render_prompt
from flashserve.server.http.errors import APIError

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = {
    "chatml": CHATML_TEMPLATE,
    **{p.stem: p.read_text() for p in sorted(FIXTURES.glob("*.jinja"))},
}
MISTRAL_TOKENS = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
MISTRAL_TOKENS += ["[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<s>", "</s>"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "abcDEF123",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict] | None, dict[str, Any]]] = {
    "one user message": ([{"role": "user", "content": "Hello, how are you?"}], None, {}),
    "system and turns": (
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy? ünïcödé ✓"},
        ],
        None,
        {},
    ),
    "tools and a call": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "abcDEF123"},
        ],
        [WEATHER],
        {},
    ),
    "reasoning, thinking off": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Adding."},
            {"role": "user", "content": "3+3?"},
        ],
        None,
        {"enable_thinking": False},
    ),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for name, template in TEMPLATES.items():
        path = tmp_path_factory.mktemp(name)
        if name.startswith("mistral"):
            build_tokenizer(
                path,
                chat_template=template,
                extra_special_tokens=MISTRAL_TOKENS,
                bos_token="<s>",
                eos_token="</s>",
            )
        else:
            build_tokenizer(path, chat_template=template)
        out[name] = load_tokenizer(path)
    return out


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_renders_as_apply_chat_template(
    tokenizers: dict[str, Any], template: str, conversation: str
) -> None:
    tokenizer = tokenizers[template]
    messages, tools, kwargs = CONVERSATIONS[conversation]
    try:
        expected = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception:  # a template that refuses this conversation must refuse it here too
        with pytest.raises(APIError) as refused:
            asyncio.run(render_prompt(tokenizer, messages, tools, kwargs, PromptLimits()))
        assert refused.value.status == 400
        return
    text, ids = asyncio.run(render_prompt(tokenizer, messages, tools, kwargs, PromptLimits()))
    assert text == expected
    assert ids == list(tokenizer.encode(expected, add_special_tokens=False))


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_the_tokenizer(tokenizers: dict[str, Any], add_special_tokens: bool) -> None:
    texts = [
        "",
        "plain words",
        "<|im_start|>user\nhi<|im_end|>\n",
        "[INST] x [/INST]</s>",
        "ünïcödé ✓ " * 50,
    ]
    for tokenizer in tokenizers.values():
        for text in texts:
            expected = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
            assert encode(tokenizer, text, add_special_tokens=add_special_tokens) == expected
