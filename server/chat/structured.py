"""Grammars for what a request forces: tool_choice and response_format.

`tool_choice: "required"` or a named function, and `response_format`
json_object / json_schema, become a Lark grammar (llguidance dialect: JSON
schemas embed as `%json {...}`) in the model's own tool-call format, which
engine.constraints turns into a logits processor. The output is then parsed
by the same tool-call parser as free output, so a forced call looks exactly
like a voluntary one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashserve.server.chat.tool_parsers import LLAMA3, ToolFormat

# Compact, deterministic JSON: no free whitespace for a model to loop in,
# separators as json.dumps and the chat templates write them.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Formats whose call syntax we can write as a grammar.
CONSTRAINABLE = ("hermes", "mistral", LLAMA3, "qwen3_coder")


class ConstraintError(ValueError):
    """A request whose constraint cannot be built; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # auto | none | required | named
    name: str | None = None


def parse_tool_choice(value: Any, tools: list[dict] | None) -> ToolChoice:
    """The request's tool_choice, validated against its tools."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise ConstraintError(
                f"tool_choice must be 'auto', 'none', 'required' or a function, not {value!r}",
                "tool_choice",
            )
        if value == "required" and not tools:
            raise ConstraintError("tool_choice 'required' needs tools", "tool_choice")
        return ToolChoice(value if tools else "none")
    if isinstance(value, dict):
        name = (
            (value.get("function") or {}).get("name") if value.get("type") == "function" else None
        )
        if not isinstance(name, str):
            raise ConstraintError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in {t["function"]["name"] for t in tools or []}:
            raise ConstraintError(
                f"tool_choice names {name!r}, which is not in tools", "tool_choice"
            )
        return ToolChoice("named", name)
    raise ConstraintError("tool_choice must be a string or an object", "tool_choice")


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters") or {}
    return params if params.get("type") else {**params, "type": "object"}


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return any(
            (k == "$ref" and isinstance(v, str)) or (k not in _DATA_KEYWORDS and _has_ref(v))
            for k, v in node.items()
        )
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _rebase(node: Any, prefix: str) -> Any:
    """`node` with every local reference (`#`, `#/...`) moved under `prefix`."""
    if isinstance(node, list):
        return [_rebase(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebase(value, prefix)
    return out


class _Defs:
    """Schemas hoisted to the root of the grammar's JSON schema.

    A tool's parameters are nested inside the call object, so their local
    references (`#/$defs/Country`, `#` for recursion; pydantic writes them for
    every nested model) would resolve against the wrong root. A schema that
    uses references is kept whole under the root's `$defs` and its references
    are rewritten to point into that copy.
    """

    def __init__(self) -> None:
        self.schemas: dict[str, dict] = {}

    def place(self, schema: dict, root: dict | None = None) -> dict:
        """`schema` (a part of `root`, or the root itself) as it can stand anywhere."""
        root = schema if root is None else root
        if not _has_ref(root):
            return schema
        key = next((k for k, v in self.schemas.items() if v is root), None)
        if key is None:
            key = f"tool_{len(self.schemas)}"
            self.schemas[key] = root
        prefix = f"#/$defs/{key}"
        return {"$ref": prefix} if schema is root else _rebase(schema, prefix)

    def rooted(self, schema: dict) -> dict:
        """`schema` as the root of a grammar's JSON, with the hoisted definitions."""
        if not self.schemas:
            return schema
        defs = {k: _rebase(v, f"#/$defs/{k}") for k, v in self.schemas.items()}
        return {**schema, "$defs": defs}


def _call_schema(tool: dict, args_key: str, defs: _Defs) -> dict:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool["function"]["name"]},
            args_key: defs.place(_parameters(tool)),
        },
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _any_call(tools: list[dict], args_key: str, defs: _Defs) -> dict:
    schemas = [_call_schema(t, args_key, defs) for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _qwen3_coder_value(schema: dict) -> str:
    """A parameter value as Qwen3-Coder writes it: raw text, typed by the schema.

    Free text includes its own trailing newline (no `<` inside), the others
    are followed by one; the parser strips that newline either way.
    """
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        values = [v if isinstance(v, str) else json.dumps(v) for v in schema["enum"]]
        return "(" + " | ".join(json.dumps(v) for v in values) + ') "\\n"'
    kind = schema.get("type")
    if kind == "integer":
        return '/-?[0-9]{1,18}/ "\\n"'
    if kind == "number":
        return '/-?[0-9]{1,18}(\\.[0-9]{1,18})?/ "\\n"'
    if kind == "boolean":
        return '("true" | "false") "\\n"'
    if kind in ("object", "array") or "$ref" in schema:
        return f'{_json(schema)} "\\n"'
    return "VALUE"


def _qwen3_coder_call(tool: dict) -> str:
    params = _parameters(tool)
    required = set(params.get("required") or [])
    name = tool["function"]["name"]
    parts = [json.dumps(f"<function={name}>\n")]
    for param, schema in (params.get("properties") or {}).items():
        opening = json.dumps(f"<parameter={param}>\n")
        # Each value is its own JSON document: references go to a copy of the parameters.
        defs = _Defs()
        value = defs.rooted(defs.place(schema or {}, params))
        part = f'{opening} {_qwen3_coder_value(value)} "</parameter>\\n"'
        parts.append(f"({part})" if param in required else f"({part})?")
    parts.append('"</function>\\n"')
    return " ".join(parts)


@dataclass(frozen=True)
class Grammar:
    """A Lark grammar as its start expression plus the rules it uses."""

    start: str
    rules: tuple[str, ...] = ()

    def text(self) -> str:
        return "\n".join((f"start: {self.start}", *self.rules))

    def __or__(self, other: Grammar) -> Grammar:
        return Grammar(f"({self.start}) | ({other.start})", self.rules + other.rules)


def tool_call_grammar(
    fmt: ToolFormat,
    tools: list[dict],
    choice: ToolChoice,
    parallel: bool,
    literal: Callable[[str], str],
) -> Grammar:
    """A grammar for one call, or several when `parallel`, of the chosen tools.

    `literal` turns a marker into a terminal (a special token where the
    tokenizer has one).
    """
    chosen = [t for t in tools if choice.mode != "named" or t["function"]["name"] == choice.name]
    many = parallel and choice.mode != "named"
    defs = _Defs()
    if fmt.name == "hermes":
        body = _json(defs.rooted(_any_call(chosen, "arguments", defs)))
        call = f'{literal(fmt.start)} "\\n" {body} "\\n" {literal(fmt.end)}'
        sep = '"\\n"'
    elif fmt.name == "mistral":
        items: dict[str, Any] = {
            "type": "array",
            "items": _any_call(chosen, "arguments", defs),
            "minItems": 1,
        }
        if not many:
            items["maxItems"] = 1
        return Grammar(f'{literal(fmt.start)} " " {_json(defs.rooted(items))}')
    elif fmt.name == LLAMA3:
        call = _json(defs.rooted(_any_call(chosen, "parameters", defs)))
        sep = '"; "'
    elif fmt.name == "qwen3_coder":
        funcs = " | ".join(f"({_qwen3_coder_call(t)})" for t in chosen)
        call = f'{literal(fmt.start)} "\\n" ({funcs}) {literal(fmt.end)}'
        sep = '"\\n"'
    else:
        raise ConstraintError(
            f"tool_choice {choice.mode!r} cannot be enforced for the {fmt.name!r} tool-call "
            f"format (enforceable: {', '.join(CONSTRAINABLE)}); use tool_choice 'auto'",
            "tool_choice",
        )
    rules = (f"call: {call}", "VALUE: /[^<]*/")
    return Grammar(f"call ({sep} call)*" if many else "call", rules)


def response_format_schema(value: dict | None) -> dict | None:
    """The JSON schema a response_format asks for, or None for plain text."""
    if not value:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise ConstraintError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ConstraintError(
                "response_format json_schema.schema must be an object", "response_format"
            )
        return schema or {"type": "object"}
    raise ConstraintError(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        "response_format",
    )


def response_format_grammar(schema: dict) -> Grammar:
    return Grammar(_json(schema))
