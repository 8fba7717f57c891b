"""Earlier assistant turns shown with the think block the model saw: the `history_thinking` setting.

Qwen3-style chat templates end a thinking-off generation prompt with an empty
`<think>\\n\\n</think>\\n\\n` block, and a thinking-on answer starts with the
model's own `<think>...</think>` block; but when the conversation comes back,
the template renders an assistant turn before the last user message without
it. The new prompt's tokens then leave the stored prompt + answer at that
block, and the prompt cache can reuse only the prompt before it: every turn
of an agent prefills the last answer again. The KV computed after the block
cannot be reused without it (positions shift, and every later key attended
to the block), so the fix is in the rendering: show the turn as the model saw
and wrote it.

- "template": the chat template decides (its canonical rendering).
- "empty" (default): a turn without reasoning, in a request with
  enable_thinking false, gets back the empty block the generation prompt
  ends with (the exact text the template appends). What the model sees is
  then what it saw when it wrote that turn; no reasoning text is added.
- "keep": also a turn whose reasoning the client passed back (reasoning_content,
  Anthropic thinking blocks, Responses reasoning items) keeps it, as
  `<think>\\n{reasoning}\\n</think>\\n\\n{content}` (the form Qwen3's templates
  give the turn they keep). Longer history; Qwen3's card advises against it,
  Qwen3.6's `preserve_thinking` does it.

A turn the template already shows with its block (e.g. after the last user
message in a tool loop) is left to the template: one probe render with each
candidate's content replaced by a marker shows where the template opens a
block itself. Only for models whose reasoning markers are `<think>` /
`</think>` and Jinja templates. This module imports nothing else from the
server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MODES = ("template", "empty", "keep")
START, END = "<think>", "</think>"
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_PROBE = "@@flashserve-probe-{}@@"


def restore_think_blocks(
    messages: list[dict[str, Any]],
    mode: str,
    enable_thinking: Any,
    render: Callable[[list[dict[str, Any]]], str],
) -> list[dict[str, Any]]:
    """`messages` (in the template's shape, reasoning under REASONING_KEYS) with
    the think block of each earlier assistant turn restored per `mode`; `render`
    renders messages with the request's template and variables (the probe)."""
    if mode not in MODES:
        raise ValueError(f"unknown history_thinking {mode!r} (known: {', '.join(MODES)})")
    if mode == "template":
        return messages
    wanted = _candidates(messages, mode, enable_thinking)
    if not wanted:
        return messages
    probe = [dict(m) for m in messages]
    for i, reasoning in wanted.items():
        probe[i] = _with_reasoning(probe[i], reasoning)
        probe[i]["content"] = _PROBE.format(i)
    try:
        text = render(probe)
    except Exception:  # the template's own checks: the real render reports them (or passes)
        log.debug("probe render failed; earlier turns left to the template", exc_info=True)
        return messages
    empty_block = _empty_generation_block(text)
    out = list(messages)
    for i, reasoning in wanted.items():
        where = text.find(_PROBE.format(i))
        if where < 0 or text[:where].rstrip().endswith(END):
            continue  # the template dropped the turn, or shows its block itself
        if reasoning:
            block = f"{START}\n{reasoning.strip(chr(10))}\n{END}\n\n"
        elif empty_block is not None:
            block = empty_block
        else:
            continue  # the generation prompt has no empty block: nothing the model saw
        content = str(messages[i].get("content") or "").lstrip("\n")
        after = text[where + len(_PROBE.format(i)) :]
        if not content and messages[i].get("tool_calls") and after.startswith("\n"):
            # The model wrote its calls right after the block; the template puts
            # a newline between content and calls (Qwen3: only when there is
            # content). The block's last newline stands for it.
            block = block.removesuffix("\n")
        # reasoning_content "" (a string) keeps Qwen-style templates from
        # splitting the block back out of the content.
        out[i] = {**_with_reasoning(messages[i], ""), "content": block + content}
    return out


def _candidates(messages: list[dict[str, Any]], mode: str, enable_thinking: Any) -> dict[int, str]:
    """Index -> the reasoning to show ("" for the empty block) of each assistant
    turn whose block may be missing. A trailing assistant message (a prefill the
    model continues) is the template's."""
    wanted = {}
    for i, message in enumerate(messages[:-1]):
        content = message.get("content")
        if message.get("role") != "assistant" or not isinstance(content or "", str):
            continue
        if END in (content or ""):
            continue  # the client sent the block in the content: the template's to handle
        reasoning = next((message[k] for k in REASONING_KEYS if message.get(k)), "")
        if not isinstance(reasoning, str):
            continue
        if reasoning.strip() and mode == "keep":
            wanted[i] = reasoning
        elif not reasoning.strip() and enable_thinking is False:
            wanted[i] = ""
    return wanted


def _with_reasoning(message: dict[str, Any], reasoning: str) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k not in REASONING_KEYS}
    out["reasoning_content"] = reasoning
    return out


def _empty_generation_block(text: str) -> str | None:
    """The empty think block the rendered generation prompt ends with, exactly as
    the template wrote it (Qwen3: "<think>\\n\\n</think>\\n\\n"), or None."""
    tail = text[text.rfind(START) :] if START in text else ""
    if END not in tail or tail.replace(START, "", 1).replace(END, "", 1).strip():
        return None
    return tail
