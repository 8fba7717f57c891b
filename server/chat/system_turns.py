"""System messages after the first: a system turn where they stand, or folded.

Agents put system messages inside the conversation: Claude Code its agent list
near the start and a background task's notification at the end (Anthropic's
beta mid-conversation-system-2026-04-07); OpenAI clients send system and
developer messages anywhere. Many chat templates render a system turn
wherever one stands (ChatML, Qwen, Llama 3). Others take a system message
only first: they refuse the rest ("roles must alternate") or silently drop
them. For those, each later system message is folded into a user turn where
it stands: appended to the user turn just before it, else put before the
text of the next user turn, else (at the end, after an assistant turn) a
user turn of its own. The model reads it either way, and the generation
prompt still follows.

prompts.py renders in place first and folds only when the template refused
the messages or left a system text out of the prompt.
"""

from __future__ import annotations

from typing import Any

SEPARATOR = "\n\n"


def late_system_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The texts of system messages other than the first message."""
    return [
        m["content"]
        for m in messages[1:]
        if m.get("role") == "system" and isinstance(m.get("content"), str) and m["content"].strip()
    ]


def all_shown(prompt: str, texts: list[str]) -> bool:
    """Whether the rendered prompt holds every text (templates may trim them)."""
    return all(text.strip() in prompt for text in texts)


def fold(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with one system message at most, first: leading system messages
    joined into it, later ones folded into user turns."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # later system texts waiting for the next user turn
    leading = True
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "system" and leading:
            if out:
                out[0] = {**out[0], "content": _join([out[0]["content"], content])}
            else:
                out.append(dict(message))
            continue
        leading = False
        if role == "system":
            text = content if isinstance(content, str) else str(content)
            last = out[-1] if out else None
            if not pending and last is not None and _is_user_text(last):
                # Right after a user turn: appended to it, so it stays where it stood.
                out[-1] = {**last, "content": _join([last["content"], text])}
            else:
                pending.append(text)
            continue
        if role == "user" and pending and isinstance(content, str):
            message = {**message, "content": _join([*pending, content])}
            pending = []
        out.append(message)
    if pending:
        out.append({"role": "user", "content": _join(pending)})
    return out


def _is_user_text(message: dict[str, Any]) -> bool:
    return message.get("role") == "user" and isinstance(message.get("content"), str)


def _join(texts: list[Any]) -> str:
    return SEPARATOR.join(str(t) for t in texts if t)
