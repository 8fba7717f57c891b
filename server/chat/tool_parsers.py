"""Tool-call formats: how a model writes a call, and how to read it back.

Each format is a start marker, an end marker ("" = the call runs to the end
of the output) and a parser for the text between them. The parsers are
mlx-lm's (mlx_lm.tool_parsers.*) except Llama 3's bare-JSON format, which
mlx-lm does not know. The format is picked from the chat template the way
mlx-lm picks it, and can be overridden with the `tool_parser` setting.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashserve.engine.weights.tokenizer import hf_tokenizer

log = logging.getLogger(__name__)

# block text (markers removed), request tools -> one call or a list of calls,
# each {"name": str, "arguments": dict | str}; raises ValueError when malformed.
ParseFn = Callable[[str, Any], Any]

# Our names for mlx-lm's parsers where theirs says less.
_ALIASES = {"hermes": "json_tools", "qwen": "json_tools", "qwen3": "json_tools"}
LLAMA3 = "llama3_json"
# Llama 3.1+ may prefix a JSON call with this marker; 3.2 writes bare JSON.
PYTHON_TAG = "<|python_tag|>"


class ToolCallParseError(ValueError):
    """A tool-call block that is not a valid call of an offered tool."""


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # "" = a call is recognised only at the start of the output
    end: str  # "" = the call block runs to the end of the output
    parse: ParseFn

    def parse_calls(self, block: str, tools: list[dict] | None) -> list[tuple[str, str]]:
        """Block text -> [(name, arguments as a JSON object string)].

        Raises ToolCallParseError for anything that is not a well-formed call
        of one of `tools` (when tools are given).
        """
        try:
            parsed = self.parse(block, tools)
        except Exception as exc:
            raise ToolCallParseError(f"{type(exc).__name__}: {exc}") from None
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not calls:
            raise ToolCallParseError("no call in block")
        offered = {t["function"]["name"] for t in tools or [] if "function" in t}
        out = []
        for call in calls:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ToolCallParseError(f"not a call: {call!r}")
            name = call["name"]
            if tools is not None and name not in offered:
                raise ToolCallParseError(f"unknown function {name!r}")
            args = call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as exc:
                    raise ToolCallParseError(f"arguments are not JSON: {exc}") from None
            if not isinstance(args, dict):
                raise ToolCallParseError(f"arguments are not a JSON object: {args!r}")
            out.append((name, json.dumps(args, ensure_ascii=False)))
        return out


def _parse_llama3(text: str, tools: Any = None) -> list[dict]:
    """`{"name": ..., "parameters": {...}}`, optionally after <|python_tag|>;
    several calls may be separated by ';' or newlines."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :].lstrip()
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if not isinstance(item, dict) or "name" not in item:
                raise ValueError(f"not a call: {item!r}")
            calls.append(item)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    if not calls:
        raise ValueError("no call")
    return calls


def available() -> list[str]:
    """Every name the tool_parser setting accepts."""
    import mlx_lm.tool_parsers as pkg

    names = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    return sorted(names | set(_ALIASES) | {LLAMA3, "none"})


def get_format(name: str) -> ToolFormat:
    """A format by name (a setting value or an inferred name)."""
    if name == LLAMA3:
        return ToolFormat(LLAMA3, "", "", _parse_llama3)
    module_name = _ALIASES.get(name, name)
    try:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
    except ImportError:
        raise ValueError(
            f"unknown tool parser {name!r} (known: {', '.join(available())})"
        ) from None
    return ToolFormat(
        "hermes" if module_name == "json_tools" else module_name,
        module.tool_call_start,
        module.tool_call_end,
        module.parse_tool_call,
    )


def infer_format_name(tokenizer: Any) -> str | None:
    """The format the model's chat template speaks, or None.

    mlx-lm's own inference first (it knows many templates), then the
    templates it does not recognise: Hermes-style templates that spell the
    call differently, and Llama 3's bare JSON.
    """
    hf = hf_tokenizer(tokenizer)
    configured = (getattr(hf, "init_kwargs", None) or {}).get("tool_parser_type")
    if configured:
        return "hermes" if configured == "json_tools" else configured
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        name = _infer_tool_parser(hf)
    except Exception:  # a private helper of mlx-lm: never let it break a request
        log.debug("mlx-lm tool parser inference failed", exc_info=True)
        name = None
    if name:
        return "hermes" if name == "json_tools" else name
    template = hf.chat_template if isinstance(getattr(hf, "chat_template", None), str) else ""
    if "<tool_call>" in template:
        return "hermes"
    if PYTHON_TAG in template or ('"parameters": ' in template and "<|eot_id|>" in template):
        return LLAMA3
    return None


def resolve_format(tokenizer: Any, setting: str | None) -> ToolFormat | None:
    """The format for this model: the setting if given, else from the template.

    Templates that name no format get Hermes markers, which is also the
    format `tool_instructions` teaches a model whose template ignores tools.
    Setting "none" turns tool-call parsing off.
    """
    if setting == "none":
        return None
    if setting and setting != "auto":
        return get_format(setting)
    name = infer_format_name(tokenizer)
    if name is None:
        return get_format("hermes")
    try:
        return get_format(name)
    except ValueError:
        log.warning("chat template names tool parser %r that mlx-lm lacks; using hermes", name)
        return get_format("hermes")


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template does anything with `tools`."""
    hf = hf_tokenizer(tokenizer)
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):  # named templates: {"default": ..., "tool_use": ...}
        return "tool_use" in template or any("tools" in t for t in template.values())
    return isinstance(template, str) and "tools" in template


def tool_instructions(tools: list[dict]) -> str:
    """A system prompt offering `tools` in Hermes format, for templates that
    drop the tools (so a small chat model can still call them)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        f"You can call these functions:\n<tools>\n{listed}\n</tools>\n"
        "To call one, reply with:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
