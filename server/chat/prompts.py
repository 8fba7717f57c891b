"""Turn a conversation into prompt token ids: off the event loop, within limits.

Messages go through the chat template (rendered to text, then encoded without
adding special tokens again: the template already holds BOS and the role
markers). Rendering and tokenizing are CPU work, so they run on a render
thread, never on the event loop: one client's 4 MB prompt or runaway template
does not stall the others or /health. Each render has `template_timeout`
seconds (then a 400, code template_timeout).

Jinja templates, the model's and a client's (only where
allow_client_chat_template permits), render in chat/sandbox.py: Jinja's
sandbox, with limits on time and size. A model whose tokenizer renders in
Python (mlx-lm's chat_template_type, a tokenizer class with its own
apply_chat_template) keeps its renderer, on the same thread and clock.

A Python thread cannot be killed. At most RENDER_THREADS renders run at once,
and a render past its time keeps its slot until it ends (the sandbox stops
templates at their next step; tokenizing ends on its own), so runaway renders
never pile up threads. A request that finds every slot busy for its whole
time limit gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2

from flashserve.engine.vision.images import ImageError
from flashserve.engine.vision.prompt import ImagePrompt
from flashserve.engine.weights.tokenizer import hf_tokenizer
from flashserve.server.chat import sandbox, system_turns, think_history
from flashserve.server.chat.conversation import PromptLimits
from flashserve.server.http.errors import RETRY_AFTER_S, SERVER_ERROR, APIError, invalid_request
from flashserve.server.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

RENDER_THREADS = 4
MIN_PROMPT_CHARS = 1_000_000
# What the server passes to every template itself; a request cannot override them.
RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt")
CLIENT_TEMPLATE = "chat_template_kwargs.chat_template"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as transformers aliases them
MESSAGE_CHARS = 500  # of an error raised by a template, in the 400's message


def prompt_limits(settings: Settings) -> PromptLimits:
    """The settings' limits. A prompt may render to twice the largest body: room
    for the template's own text, not for a template that multiplies its input."""
    return PromptLimits(
        timeout=settings.template_timeout,
        max_chars=max(2 * settings.max_body_bytes, MIN_PROMPT_CHARS),
        allow_client_template=settings.allow_client_chat_template,
    )


def template_timeout(seconds: float, param: str | None) -> APIError:
    # 400, not 408 or 504: the request's own prompt or template is the cause,
    # and sending it again would take as long.
    return APIError(
        400,
        f"Rendering and tokenizing the prompt took longer than {seconds:g} s "
        "(the server's template_timeout).",
        param=param,
        code="template_timeout",
    )


class RenderSlots:
    """At most `slots` render threads at once; a thread keeps its slot until it ends."""

    def __init__(self, slots: int):
        self._free = threading.BoundedSemaphore(slots)

    async def run(self, job: Callable[[float], T], *, timeout: float, param: str | None) -> T:
        """`job(deadline)` on a render thread; its result, or its APIError.

        `deadline` (time.monotonic()) bounds waiting for a slot and the job
        together: 503 render_busy when no slot frees in time, 400
        template_timeout when the job is not done in time.
        """
        deadline = time.monotonic() + timeout
        while not self._free.acquire(blocking=False):
            if time.monotonic() >= deadline:
                raise APIError(
                    503,
                    "Every prompt render slot is busy; retry later.",
                    type=SERVER_ERROR,
                    code="render_busy",
                    headers={"Retry-After": RETRY_AFTER_S},
                )
            await asyncio.sleep(0.01)  # only while all slots are taken
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def deliver(ok: bool, value: Any) -> None:
            if not future.done():  # the request may have timed out or gone
                future.set_result(value) if ok else future.set_exception(value)

        def work() -> None:
            try:
                outcome = (True, job(deadline))
            except BaseException as exc:  # handed to the request, raised there
                outcome = (False, exc)
            finally:
                self._free.release()
            with contextlib.suppress(RuntimeError):  # the event loop closed (shutdown)
                loop.call_soon_threadsafe(deliver, *outcome)

        threading.Thread(target=work, name="flashserve-render", daemon=True).start()
        try:
            return await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            log.warning("prompt rendering passed template_timeout (%g s)", timeout)
            raise template_timeout(timeout, param) from None


_SLOTS = RenderSlots(RENDER_THREADS)


async def run_render_job(job: Callable[[float], T], limits: PromptLimits, param: str | None) -> T:
    """Run `job(deadline)` on a render thread within `limits.timeout` (see RenderSlots)."""
    return await _SLOTS.run(job, timeout=limits.timeout, param=param)


async def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None = None,
    limits: PromptLimits | None = None,
    param: str = "messages",
    history_thinking: str = "template",
    images: ImagePrompt | None = None,
) -> tuple[str, list[int]]:
    """Render the chat template; return (prompt text, prompt token ids).

    `messages` and `tools` are what the template reads (chat/tooling.py,
    template_inputs); a 400 naming `param` when the template rejects them.
    `history_thinking` restores earlier turns' think blocks (chat/think_history.py;
    "template" leaves them to the template). `images`: the request's images, whose
    placeholders become the model's image tokens.
    """
    limits = limits or PromptLimits()
    kwargs = dict(chat_template_kwargs or {})
    client_template = kwargs.pop("chat_template", None)
    if client_template is not None:
        if not limits.allow_client_template:
            raise invalid_request(
                f"{CLIENT_TEMPLATE}: this server does not accept chat templates from "
                "requests (setting allow_client_chat_template is off).",
                CLIENT_TEMPLATE,
                "client_template_disabled",
            )
        if not isinstance(client_template, str):
            raise invalid_request(f"{CLIENT_TEMPLATE} must be a string.", CLIENT_TEMPLATE)
    for key in RESERVED_KWARGS:
        if key in kwargs:
            raise invalid_request(
                f"chat_template_kwargs.{key} is set by the server; send it as the request's "
                "own field.",
                f"chat_template_kwargs.{key}",
            )
    job = _RenderJob(
        tokenizer, messages, tools, kwargs, client_template, limits, param, history_thinking, images
    )
    return await run_render_job(job.run, limits, param)


@dataclass(frozen=True)
class _RenderJob:
    """One prompt to render and tokenize on a render thread."""

    tokenizer: Any
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    client_template: str | None
    limits: PromptLimits
    param: str
    history_thinking: str = "template"
    images: ImagePrompt | None = None

    def run(self, deadline: float) -> tuple[str, list[int]]:
        """Template -> text -> token ids."""
        return _render_and_encode(self, deadline)


def _render_and_encode(job: _RenderJob, deadline: float) -> tuple[str, list[int]]:
    tokenizer, limits, param = job.tokenizer, job.limits, job.param
    text = _render_system_turns(job, deadline)
    if not isinstance(text, str):
        raise invalid_request("The chat template did not render text.", param)
    if len(text) > limits.max_chars:
        raise invalid_request(
            f"The rendered prompt is longer than {limits.max_chars} characters.",
            param,
            "template_limit",
        )
    try:
        if job.images is not None:
            text = job.images.expand(text)
        ids = encode(tokenizer, check_unicode(text, param), add_special_tokens=False)
        if job.images is not None:
            ids = job.images.mark(ids)
    except ImageError as exc:
        raise invalid_request(str(exc), param, "invalid_image") from None
    if not ids:
        raise invalid_request("The chat template rendered an empty prompt.", param, "empty_prompt")
    return text, ids


def _render_system_turns(job: _RenderJob, deadline: float) -> str:
    """The prompt with system messages after the first where they stand, or folded
    into user turns when the template refuses or drops them (system_turns.py)."""
    late = system_turns.late_system_texts(job.messages)
    if not late:
        return _render_text(job, deadline)
    try:
        text: str | None = _render_text(job, deadline)
    except APIError as exc:
        if exc.detail.code is not None:  # a limit (time, size), not a refusal
            raise
        text = None
    if isinstance(text, str) and system_turns.all_shown(text, late):
        return text
    log.info("chat template takes a system message only first: folding the later ones")
    folded = dataclasses.replace(job, messages=system_turns.fold(job.messages))
    return _render_text(folded, deadline)


def _render_text(job: _RenderJob, deadline: float) -> str:
    tokenizer, messages, tools, kwargs = job.tokenizer, job.messages, job.tools, job.kwargs
    client_template, limits, param = job.client_template, job.limits, job.param
    hf = hf_tokenizer(tokenizer)
    if client_template is None and not getattr(tokenizer, "has_chat_template", False):
        return _plain_transcript(messages)
    if client_template is None and not _renders_with_jinja(tokenizer, hf):
        return _python_renderer(tokenizer, messages, tools, kwargs, param)
    source = _template_source(hf, client_template, tools, param)
    variables = _template_variables(tokenizer, hf, messages, tools, kwargs)
    where = CLIENT_TEMPLATE if client_template is not None else param

    def render(shown: list[dict[str, Any]]) -> str:
        return sandbox.render(
            source, {**variables, "messages": shown}, max_chars=limits.max_chars, deadline=deadline
        )

    try:
        shown = think_history.restore_think_blocks(
            variables["messages"], job.history_thinking, variables.get("enable_thinking"), render
        )
        return render(shown)
    except sandbox.TemplateTimeoutError:
        log.warning("chat template stopped at template_timeout (%g s)", limits.timeout)
        raise template_timeout(limits.timeout, where) from None
    except sandbox.TemplateSizeError as exc:
        log.warning("chat template stopped at a size limit: %s", exc)
        raise invalid_request(
            f"The chat template went past a size limit: {exc}.", where, "template_limit"
        ) from None
    except jinja2.TemplateSyntaxError as exc:
        raise invalid_request(f"The chat template is not valid: {_short(exc)}", where) from None
    except jinja2.TemplateError as exc:
        # Templates reject what they cannot render, e.g. roles out of order.
        raise invalid_request(
            f"The chat template rejected the messages: {_short(exc)}", where
        ) from None
    except Exception as exc:  # the template's own code: any error is about this request
        raise invalid_request(
            f"Cannot render the messages: {type(exc).__name__}: {_short(exc)}", where
        ) from None


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "..."


def _renders_with_jinja(tokenizer: Any, hf: Any) -> bool:
    """True when apply_chat_template would render hf.chat_template with Jinja."""
    if getattr(tokenizer, "_chat_template", None) is not None:
        return False  # mlx-lm's Python renderer (chat_template_type)
    method = getattr(type(hf), "apply_chat_template", None)
    inherited = getattr(method, "__qualname__", "") == "PreTrainedTokenizerBase.apply_chat_template"
    return inherited and isinstance(getattr(hf, "chat_template", None), (str, dict))


def _python_renderer(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    param: str,
) -> str:
    # The model's own code: trusted, but still on this thread and clock.
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except jinja2.TemplateError as exc:
        raise invalid_request(
            f"The chat template rejected the messages: {_short(exc)}", param
        ) from None
    except (TypeError, ValueError, KeyError) as exc:
        raise invalid_request(f"Cannot render the messages: {_short(exc)}", param) from None


def _template_source(hf: Any, client_template: str | None, tools: Any, param: str) -> str:
    """The template apply_chat_template would pick (a client's, or the model's)."""
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):
        # Several named templates: a client may name one; tools pick "tool_use".
        if client_template is not None:
            return template.get(client_template, client_template)
        if tools and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise invalid_request(
            f"The model has several chat templates and no default ({sorted(template)}); "
            f"name one in {CLIENT_TEMPLATE}.",
            param,
        )
    return client_template if client_template is not None else template


def _template_variables(
    tokenizer: Any,
    hf: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> dict[str, Any]:
    """What the template sees: as transformers' apply_chat_template through mlx-lm's
    wrapper (special tokens, then the request's kwargs, enable_thinking's default)."""
    variables = {**dict(getattr(hf, "special_tokens_map", None) or {}), **kwargs}
    variables.setdefault("enable_thinking", bool(getattr(tokenizer, "has_thinking", False)))
    documents = variables.pop("documents", None)
    return {
        **variables,
        "messages": [_template_message(m) for m in messages],
        "tools": tools or None,
        "documents": documents,
        "add_generation_prompt": True,
    }


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    # Keys set to None are dropped (templates test for presence); a message's
    # reasoning goes under every name templates read it by.
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`, as tokenizer.encode gives them.

    For a Rust tokenizer set up as transformers sets it up to encode (no
    truncation or padding, the same special-token splitting), the batch-fast
    path: the same ids without character offsets. Computing and then freeing
    offsets for megabytes of text costs seconds, and the freeing holds the
    GIL (stalling the event loop).
    """
    hf = hf_tokenizer(tokenizer)
    backend = getattr(hf, "_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if (
        fast is not None
        and getattr(backend, "truncation", None) is None
        and getattr(backend, "padding", None) is None
        and bool(getattr(backend, "encode_special_tokens", False))
        == bool(getattr(hf, "split_special_tokens", False))
    ):
        return list(fast([text], add_special_tokens=add_special_tokens)[0].ids)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


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
