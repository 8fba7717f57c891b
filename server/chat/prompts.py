"""Turn a conversation into prompt token ids.

Messages go through the tokenizer's chat template (rendered to text, then
encoded without adding special tokens again: the template already holds BOS
and the role markers). Tokenizing is CPU work in Rust; it runs on the event
loop, never MLX.
"""

from __future__ import annotations

import logging
from typing import Any

import jinja2

from flashserve.server.http.errors import invalid_request

log = logging.getLogger(__name__)


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None = None,
    param: str = "messages",
) -> tuple[str, list[int]]:
    """Render the chat template; return (prompt text, prompt token ids).

    `messages` and `tools` are what the template reads (chat/tooling.py,
    template_inputs); a 400 naming `param` when the template rejects them.
    """
    kwargs = dict(chat_template_kwargs or {})
    if getattr(tokenizer, "has_chat_template", False):
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            # Templates reject what they cannot render, e.g. roles out of order.
            raise invalid_request(
                f"The chat template rejected the messages: {exc}", param
            ) from None
        except (TypeError, ValueError, KeyError) as exc:
            raise invalid_request(f"Cannot render the messages: {exc}", param) from None
    else:
        text = _plain_transcript(messages)
    return text, list(tokenizer.encode(check_unicode(text, param), add_special_tokens=False))


def check_unicode(text: str, param: str) -> str:
    """JSON may escape lone surrogates (\\ud800) that no tokenizer can encode: a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_request(
            f"The text is not valid Unicode: {exc.reason} at character {exc.start}.", param
        ) from None
    return text


def _plain_transcript(messages: list[dict[str, Any]]) -> str:
    # A model without a chat template (a base model) still gets a readable prompt.
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"
