"""Turn request messages / prompts into prompt token ids.

Chat messages go through the tokenizer's chat template (rendered to text, then
encoded without adding special tokens again: the template already holds BOS
and the role markers). Tokenizing is CPU work in Rust; it runs on the event
loop, never MLX.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import jinja2

from .errors import invalid_request
from .schemas import ChatCompletionRequest, ContentPart

log = logging.getLogger(__name__)


def content_text(content: str | Sequence[ContentPart] | None) -> str | None:
    """A message's content as one string: text parts are joined with newlines."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text or "" for part in content)


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template."""
    out = []
    for message in body.messages:
        data = message.model_dump(exclude_none=True)
        data["content"] = content_text(message.content)
        if data["role"] == "developer":
            # Chat templates predate the developer role; it is a system message.
            data["role"] = "system"
        if data["content"] is None:
            data["content"] = ""
        out.append(data)
    return out


def render_chat(
    tokenizer: Any,
    body: ChatCompletionRequest,
    adapt: Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], Any]] | None = None,
) -> tuple[str, list[int]]:
    """Render the chat template; return (prompt text, prompt token ids).

    `adapt` (server/chat_tools.py) turns the messages into what the template
    expects and returns them with the tools to offer.
    """
    messages = template_messages(body)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    if adapt is not None:
        messages, tools = adapt(messages)
    kwargs = dict(body.chat_template_kwargs or {})
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
            raise invalid_request(f"The chat template rejected the messages: {exc}", "messages")
        except (TypeError, ValueError, KeyError) as exc:
            raise invalid_request(f"Cannot render the messages: {exc}", "messages")
    else:
        text = _plain_transcript(messages)
    return text, list(tokenizer.encode(check_unicode(text, "messages"), add_special_tokens=False))


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


def encode_completion_prompt(tokenizer: Any, prompt: Any, vocab_size: int) -> list[int]:
    """A /v1/completions prompt (a string or token ids, one prompt) -> token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = list(tokenizer.encode(check_unicode(prompt, "prompt")))
    else:
        tokens = [int(t) for t in prompt]
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise invalid_request(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                "prompt",
            )
    if not tokens:
        raise invalid_request("The prompt is empty.", "prompt")
    return tokens
