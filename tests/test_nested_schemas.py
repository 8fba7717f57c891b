"""Tool schemas the way client libraries write them: `$defs`, `$ref`, recursion.

pydantic (and so `openai.pydantic_function_tool`, instructor, pydantic-ai) puts
every nested model under `$defs` and refers to it with `#/$defs/Name`. Forced
tool calls nest the parameters inside a call object, so the references must be
resolved against the tool's own schema. The grammars are walked token by token
with llguidance (every format), and a real server answers a forced call on a tiny
real model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from flashserve.engine.generation.constraints import compile_grammar, literal, ll_tokenizer
from flashserve.server.chat.output_parser import OutputParser
from flashserve.server.chat.structured import ToolChoice, tool_call_grammar
from flashserve.server.chat.tool_parsers import get_format

from .conftest import Server
from .scripted import make_templated_model, script, scripted_server


class Country(BaseModel):
    model_config = ConfigDict(extra="forbid")  # else a random model adds keys forever
    name: str = Field(max_length=12)
    code: Literal["FR", "IT", "NO"]


class Trip(BaseModel):
    """A trip: nested models become $defs / $ref in the schema."""

    model_config = ConfigDict(extra="forbid")

    destination: Country
    stops: list[Country] = Field(max_length=2)


class Node(BaseModel):
    """A recursive model: the schema refers to itself."""

    model_config = ConfigDict(extra="forbid")

    label: Literal["a", "b"]
    children: list[Node] = Field(max_length=1)


TRIP_TOOL = openai.pydantic_function_tool(Trip, name="plan_trip")
NODE_TOOL = openai.pydantic_function_tool(Node, name="make_tree")
ROOT_RECURSIVE = {
    "type": "function",
    "function": {
        "name": "nest",
        "parameters": {
            "type": "object",
            "properties": {"inner": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["inner"],
        },
    },
}


def _strict_off(tool: dict) -> dict:
    """As sent by clients that do not use OpenAI's strict mode."""
    function = {k: v for k, v in tool["function"].items() if k != "strict"}
    return {"type": "function", "function": function}


TOOLS = [_strict_off(TRIP_TOOL), _strict_off(NODE_TOOL), ROOT_RECURSIVE]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_templated_model(tmp_path_factory.mktemp("schemas") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Iterator[Server]:
    with scripted_server(qwen3_dir) as server:
        yield server


def _walk(tokenizer: object, grammar_text: str, seed: int) -> str:
    """Text a grammar lets through on a random walk over its allowed tokens; after a
    while the walk prefers tokens that close (so recursive schemas end)."""
    from llguidance import LLMatcher

    rng = np.random.default_rng(seed)
    matcher = LLMatcher(ll_tokenizer(tokenizer), grammar_text)
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    decode = tokenizer.decode  # type: ignore[attr-defined]
    out: list[int] = []
    for step in range(600):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.nonzero(bits)[0]
        assert allowed.size, matcher.get_error()
        closers = [t for t in allowed if t == eos or decode([int(t)])[:1] in ("]", "}", "<")]
        pool = closers if closers and step > 30 else allowed
        token = int(rng.choice(pool))
        if token == eos:
            break
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return decode(out)


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json", "qwen3_coder"])
@pytest.mark.parametrize("tool", ["plan_trip", "make_tree", "nest"])
def test_forced_calls_with_references_compile_and_parse(
    fmt: str, tool: str, qwen3_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    grammar = tool_call_grammar(
        get_format(fmt), TOOLS, ToolChoice("named", tool), False, lambda s: literal(tokenizer, s)
    )
    compiled = compile_grammar(tokenizer, grammar.text())
    for seed in (0, 1):
        text = _walk(tokenizer, compiled, seed)
        parser = OutputParser(tool_format=get_format(fmt), tools=TOOLS)
        parser.feed(text)
        parser.finish()
        assert [c.name for c in parser.tool_calls] == [tool], text
        args = json.loads(parser.tool_calls[0].arguments)
        if tool == "plan_trip" and fmt != "qwen3_coder":
            Trip.model_validate(args)
        elif tool == "make_tree" and fmt != "qwen3_coder":
            Node.model_validate(args)
        elif tool == "nest":
            assert "inner" in args


def test_server_forces_a_call_with_nested_models(qwen3: Server) -> None:
    client = qwen3.client()
    messages = [{"role": "user", "content": "Plan a trip."}]
    for choice in ("required", {"type": "function", "function": {"name": "plan_trip"}}):
        response = client.chat.completions.create(
            model=qwen3.model_id,
            messages=messages,
            tools=[TRIP_TOOL],
            tool_choice=choice,
            temperature=0,
            max_tokens=200,
        )
        calls = response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "tool_calls", response
        assert calls and calls[0].function.name == "plan_trip"
        Trip.model_validate_json(calls[0].function.arguments)
    # The SDK's own parse helper, with strict tools, as its documentation shows.
    parsed = client.chat.completions.parse(
        model=qwen3.model_id,
        messages=messages,
        tools=[TRIP_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=200,
    )
    call = parsed.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Trip)


def test_response_format_with_nested_models(qwen3: Server) -> None:
    schema = Trip.model_json_schema()
    response = qwen3.client().chat.completions.create(
        model=qwen3.model_id,
        messages=[{"role": "user", "content": "Plan a trip."}],
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}},
        temperature=0,
        max_tokens=600,
    )
    assert response.choices[0].finish_reason == "stop", response
    Trip.model_validate_json(response.choices[0].message.content or "")


def test_a_bad_reference_is_a_400_without_grammar_text(qwen3: Server) -> None:
    broken = {
        "type": "function",
        "function": {
            "name": "broken",
            "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}},
        },
    }
    response = qwen3.http().post(
        "/v1/chat/completions",
        json={
            "model": qwen3.model_id,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [broken],
            "tool_choice": "required",
        },
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice"
    assert "Missing" in error["message"]
    for internal in ("%json", "start:", "<state>", "<grammar>", "x-guidance"):
        assert internal not in error["message"], error["message"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
FIRST = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SECOND = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def test_a_cut_off_call_never_leaks_markup(qwen3: Server, qwen3_dir: Path) -> None:
    """The model writes one call, starts a second, and max_tokens cuts it: the complete
    call is returned, the cut one is dropped, content carries no markup, finish is length.
    Also when the output stops inside a call (no max_tokens cut)."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    full = FIRST + SECOND
    cut_at = len(
        tokenizer.encode(FIRST + '\n<tool_call>\n{"name": "get_w', add_special_tokens=False)
    )
    client = qwen3.client()
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    kwargs: dict = {
        "model": qwen3.model_id,
        "messages": messages,
        "tools": [WEATHER],
        "max_tokens": cut_at,
    }
    response = client.chat.completions.create(**kwargs, **script(full))
    choice = response.choices[0]
    assert choice.finish_reason == "length", choice
    assert not choice.message.content, choice.message.content
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    content, names, finish = "", [], None
    for chunk in client.chat.completions.create(**kwargs, **script(full), stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            names += [c.function.name for c in choice.delta.tool_calls or [] if c.function.name]
            finish = choice.finish_reason or finish
    assert (content, names, finish) == ("", ["get_weather"], "length")
    # The scripted output itself ends inside a block (then EOS): dropped as well.
    unterminated = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    response = client.chat.completions.create(
        model=qwen3.model_id, messages=messages, tools=[WEATHER], **script(unterminated)
    )
    assert not response.choices[0].message.content
    assert not response.choices[0].message.tool_calls


def test_strict_types_where_the_schema_promises_them(qwen3: Server) -> None:
    """JSON booleans are not integers: `top_logprobs: false` and a prompt `[[false]]`
    were read as 0 (and `logprobs: true` is no count of logprobs); an empty prompt is
    refused and the published schema says so."""
    http = qwen3.http()
    chat = {"model": qwen3.model_id, "messages": [{"role": "user", "content": "x"}]}
    response = http.post("/v1/chat/completions", json={**chat, "top_logprobs": False})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "top_logprobs"
    for bad in ({"prompt": [[False]]}, {"prompt": [True, 1]}, {"prompt": ""}, {"logprobs": True}):
        body = {"model": qwen3.model_id, "prompt": "x", "max_tokens": 1, **bad}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, (bad, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    ok = http.post(
        "/v1/completions", json={"model": qwen3.model_id, "prompt": [[1, 2]], "max_tokens": 1}
    )
    assert ok.status_code == 200, ok.text
    schema = http.get("/openapi.json").json()["components"]["schemas"]
    prompt = schema["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "string", "minLength": 1} in prompt["anyOf"]
