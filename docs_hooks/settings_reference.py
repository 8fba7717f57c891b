"""MkDocs hook: the settings reference page, rendered from the settings object.

docs/reference/settings.md holds a placeholder; at build time it becomes one
table per section of config.example.toml, one row per field of
`flashserve.server.settings.Settings` (name, default, values, meaning). The
rows come from the object itself, so a setting added to it appears on the page
without anyone editing the docs; the meaning is the field's description, else
its comment in config.example.toml (which tests/test_settings.py keeps
complete).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

from pydantic_core import PydanticUndefined

from flashserve.server.settings import Settings

PLACEHOLDER = "<!-- settings-table -->"
EXAMPLE = Path(__file__).resolve().parent.parent / "config.example.toml"
_KEY_LINE = re.compile(r"^#?\s*([a-z_]+)\s*=\s*(.*)$")
_SECTION = re.compile(r"^# --- (.+?) ---")
_CONTINUATION = re.compile(r"^\s{8,}#\s?(.*)$")


def example_comments() -> tuple[dict[str, str], dict[str, str]]:
    """config.example.toml's comment for each key, and the section each key is in."""
    comments: dict[str, str] = {}
    sections: dict[str, str] = {}
    section, last = "other", None
    for line in EXAMPLE.read_text().splitlines():
        if match := _SECTION.match(line):
            section, last = match.group(1).split(" (")[0], None
        elif (match := _KEY_LINE.match(line)) and match.group(1) in Settings.model_fields:
            last = match.group(1)
            sections[last] = section
            value = match.group(2)
            # The comment after the value; a value never holds " #" in this file.
            comments[last] = value.split(" #", 1)[1].strip() if " #" in value else ""
        elif last and (match := _CONTINUATION.match(line)):
            comments[last] = f"{comments[last]} {match.group(1).strip()}".strip()
        else:
            last = None
    return comments, sections


def _size_fields() -> set[str]:
    decorators = Settings.__pydantic_decorators__.field_validators
    return set(decorators["_sizes"].info.fields) if "_sizes" in decorators else set()


def _human_bytes(value: int) -> str:
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if value >= scale and value % (scale // 100) == 0:
            return f"{value / scale:g} {unit}"
    return f"{value} bytes"


def _default(name: str) -> str:
    field = Settings.model_fields[name]
    value: Any = field.default
    if value is PydanticUndefined and field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if name in _size_fields() and isinstance(value, int) and value:
        return f"`{value}` ({_human_bytes(value)})"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


def _values(name: str) -> str:
    annotation = Settings.model_fields[name].annotation
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if name in _size_fields():
        return "size (`3GB`, `512MiB`, bytes)"
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    return {str: "text", int: "integer", float: "number", bool: "true / false"}.get(
        base, "list of text" if typing.get_origin(base) is list else str(base)
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_settings() -> str:
    """Markdown tables of every setting, grouped as config.example.toml groups them."""
    comments, sections = example_comments()
    # Sections in the example file's order; a key it lacks goes to "other", last.
    groups: dict[str, list[str]] = {section: [] for section in dict.fromkeys(sections.values())}
    for name in Settings.model_fields:
        groups.setdefault(sections.get(name, "other"), []).append(name)
    out = []
    for section, names in groups.items():
        if not names:
            continue
        out += [f"## {section[0].upper()}{section[1:]}", ""]
        out += ["| setting | default | values | meaning |", "|---|---|---|---|"]
        for name in names:
            field = Settings.model_fields[name]
            meaning = field.description or comments.get(name, "")
            row = [f"`{name}`", _default(name), _values(name), _cell(meaning)]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Fill the placeholder of the settings page (every other page passes through)."""
    if PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(PLACEHOLDER, render_settings())
