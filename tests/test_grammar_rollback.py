"""A grammar run ahead over a speculative draft is taken back past what was rejected,
a stop included (engine/generation/constraints.py, engine/speculative/batch.py).

The speculative step calls a request's processors once per drafted position,
the context growing by one drafted token each time; a rejected draft leaves
them a shorter context next step. A draft that completed the grammar (the
JSON object's closing brace, or EOS) stopped the matcher: it must be undone
like any other token, or only EOS is allowed from there on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import tests.scripted as scripted
from flashserve.engine.generation.constraints import GrammarProcessor, compile_grammar
from flashserve.engine.weights.synthetic import build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a"],
}
VOCAB = 320  # build_tokenizer's


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("grammar-tokenizer")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def allowed(processor: GrammarProcessor, context: list[int]) -> list[int]:
    """The tokens `processor` allows after `context`."""
    out = processor(mx.array(context), mx.zeros((1, VOCAB)))
    return np.flatnonzero(np.isfinite(np.array(out[0]))).tolist()


def check_rejected_draft(tokenizer: Any, lark: str, written: str, draft: list[int]) -> None:
    """Run a grammar over `draft` after `written` as a speculative step does, reject
    the whole draft, emit the token a plain run would allow first instead, and
    compare each following mask with a plain run's over the same tokens."""
    grammar = compile_grammar(tokenizer, lark)
    prompt = tokenizer.encode("JSON:", add_special_tokens=False)
    out = tokenizer.encode(written, add_special_tokens=False)
    plain = GrammarProcessor(tokenizer, grammar)
    spec = GrammarProcessor(tokenizer, grammar)
    allowed(plain, prompt)
    allowed(spec, prompt)
    for i in range(1, len(out)):  # the output so far, one plain step each
        allowed(plain, prompt + out[:i])
        allowed(spec, prompt + out[:i])
    context = prompt + out
    for j in range(len(draft) + 1):  # the pending token, then each drafted one
        mask = allowed(spec, context + draft[:j])
        assert j == len(draft) or draft[j] in mask  # the grammar allows the draft
    # Every drafted token rejected: the model's own next token follows the pending one.
    expected = allowed(plain, context)
    other = next(t for t in expected if t != draft[0])
    assert allowed(spec, [*context, other]) == allowed(plain, [*context, other])
    assert allowed(spec, context) == expected  # taken back again, to before `other`


def test_rejected_brace_that_completed_the_object_is_taken_back(tokenizer: Any) -> None:
    brace = tokenizer.encode("}", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    check_rejected_draft(tokenizer, f"start: %json {json.dumps(SCHEMA)}", '{"a": 1', [*brace, eos])


def test_rejected_eos_is_taken_back(tokenizer: Any) -> None:
    """A grammar that may go on or end: a drafted EOS stops it, and is rejected."""
    check_rejected_draft(tokenizer, 'start: ("ab")+', "abab", [tokenizer.eos_token_id])


class Preferred:
    """ForcedTokens' script as a bias, not a mask: a drafted token the grammar allows
    passes the processors and is rejected by the model (ForcedTokens would cut the
    draft before the grammar saw it)."""

    speculative_ok = True

    def __init__(self, token_ids: list[int], eos_id: int):
        self._script = [*token_ids, eos_id]
        self._start: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._start is None:
            self._start = tokens.shape[0]
        step = min(tokens.shape[0] - self._start, len(self._script) - 1)
        bias = np.zeros((logits.shape[-1],), dtype=np.float32)
        bias[self._script[step]] = 1e4
        return logits + mx.array(bias)


def test_server_keeps_the_json_going_after_a_rejected_closing_brace(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt holds `{"a": 1}`: prompt lookup drafts `}` and the turn's end after
    `{"a": 1`, completing the object; the model says `, "b": 2}` instead. The whole
    object comes back, not `{"a": 1,`."""
    monkeypatch.setattr(scripted, "ForcedTokens", Preferred)
    answer = '{"a": 1, "b": 2}'
    body = {
        "messages": [{"role": "user", "content": 'Repeat {"a": 1} as JSON: {"a": 1}'}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}},
    }
    headers = {scripted.SCRIPT_HEADER: json.dumps(answer)}
    with scripted.scripted_server(
        tiny_llama_dir, speculative="prompt-lookup", speculative_max_draft=6
    ) as server:
        response = server.http().post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        stats = server.health().json()["stats"]["speculative"]
    assert response.json()["choices"][0]["message"]["content"] == answer
    assert stats["drafted_tokens"] > stats["accepted_tokens"] > 0  # a draft was rejected
