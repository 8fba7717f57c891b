"""Schemathesis hooks for tests/test_openapi.py (loaded by `st run` via SCHEMATHESIS_HOOKS).

One check replaces the built-in `positive_data_acceptance`: schema-valid data
must be accepted, except for the refusals that no JSON Schema can state, listed
in BEYOND_SCHEMA (each depends on another field of the body or on the model
served). Every other 400 to schema-valid data still fails the run, and so does
any refusal a request model's validation gives (those must agree with the
published schema). A before_call hook names the served model in /v1/messages
bodies, so that generated requests get past the model check (before_call below).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import httpx
import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# (param, message) patterns of 400s to schema-valid bodies that the schema cannot rule out.
BEYOND_SCHEMA: list[tuple[str, str]] = [
    # prompt + max_tokens against the model's context: a sum over two fields.
    (r"max_tokens|max_completion_tokens|messages|prompt", r"maximum context length"),
    (r"max_output_tokens|input", r"maximum context length"),  # the same, in Responses
    (r"prompt", r"^prompt is too long: \d+ tokens > \d+ maximum$"),  # Anthropic's words
    # Token ids against the model's vocabulary size (the schema says: digits, >= 0).
    (r"logit_bias|prompt", r"outside the vocabulary"),
    # A named or required tool_choice against the request's own tools.
    (r"tool_choice", r"which is not in tools|needs tools"),
    # A client's own chat template: taken only where the server's settings allow it.
    (r"chat_template_kwargs\.chat_template", r"does not accept chat templates"),
    # What a string holds (a call's arguments: a JSON object): contentSchema is an
    # annotation, which JSON Schema validators do not assert.
    (r"messages\.\d+\.tool_calls\.\d+\.function\.arguments", r"must be a JSON object string"),
    (r"input\[\d+\]\.arguments", r"function_call arguments must be a JSON object"),
    # A Responses function_call_output answers a function_call earlier in the
    # conversation (its call_id): a reference between items, or to a stored response.
    (r"input\[\d+\]\.call_id", r"No tool call found for function call output"),
    # Anthropic's prefill (a final assistant message), which the chat pipeline cannot
    # continue: JSON Schema has no keyword for an array's last item.
    (r"messages\.\d+\.role", r"final assistant message \(prefill\)"),
    # n against the server's max_batch (a setting); top_logprobs above 0 without
    # logprobs, and max_tokens 0 without echo (two fields each).
    (r"n", r"choices per request \(its max_batch\)"),
    (r"top_logprobs", r"top_logprobs needs logprobs"),
    (r"max_tokens", r"max_tokens 0 asks for no completion"),
    # A suffix (fill in the middle) with echo: two fields.
    (r"suffix", r"suffix cannot be used with echo"),
    # A user's image against the model served: a text-only model refuses it.
    (r"messages\.\d+\.content\.\d+(\.source)?", r"this model accepts text only"),
    (r"input\[\d+\]\.content\[\d+\]\.type", r"this model accepts text only"),
]


def beyond_schema(response: Any) -> bool:
    """Whether a 400 is one of the refusals in BEYOND_SCHEMA."""
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    message = error.get("message") or ""
    # Anthropic's error object has no param: server/http/errors.py names the field in
    # the message instead (as a "param: " prefix where the message does not name it).
    params = [error["param"] or ""] if "param" in error else re.findall(r"[\w.]+", message)
    return any(
        any(re.fullmatch(param_pattern, param) for param in params)
        and re.search(message_pattern, message)
        for param_pattern, message_pattern in BEYOND_SCHEMA
    )


@schemathesis.check
def positive_data_accepted(ctx: Any, response: Any, case: Any) -> bool | None:
    """positive_data_acceptance, less the refusals in BEYOND_SCHEMA."""
    if response.status_code == 400 and beyond_schema(response):
        return None
    return positive_data_acceptance(ctx, response, case)


# The paths whose body must name the served model (required, as in Anthropic's API):
# any other name answers 404 before the body is used, so generated strings would never
# reach the server's core logic.
MODEL_REQUIRED = "/v1/messages"


@functools.cache
def served_model(base_url: str) -> str:
    # /health is an open path: it needs no key.
    return httpx.get(base_url.rstrip("/") + "/health", timeout=30.0).json()["model"]


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """On MODEL_REQUIRED paths a generated *string* model becomes the served model's
    name (any string is schema-valid, so a case stays positive or negative as it was);
    a model of another type, or none, is left to be refused."""
    body = case.body
    if (
        case.path.startswith(MODEL_REQUIRED)
        and isinstance(body, dict)
        and isinstance(body.get("model"), str)
    ):
        base_url = kwargs.get("base_url") or case.operation.schema.get_base_url()
        body["model"] = served_model(base_url)
