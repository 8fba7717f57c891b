"""The OpenAPI document (/openapi.json), as the server really answers.

FastAPI derives the document from the routes and their pydantic models; each
route states its own error statuses (`responses=error_responses(...)`, errors.py)
and, when it streams, `event_stream(...)` below. What no route can state is
settled here, once, when the document is first asked for:
- validation errors answer 400 with an error object (errors.py), never 422:
  FastAPI's automatic 422 entries and their HTTPValidationError schema go;
- middleware answers some statuses on every route before the route runs: 400
  (the Host check of a server without an API key), 401 (the API key, when one
  is set, except on the open paths) and 413 (the body limit). Every operation
  lists them, with the error object of its path's dialect;
- bounds of integers are written as integers (FastAPI writes doubles);
- with an API key, the two ways to send it (Authorization: Bearer, x-api-key)
  are the document's security schemes, required on every operation but the open
  ones. A server without a key declares none: the document describes the
  server as configured.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from flashserve.server.http.errors import AnthropicErrorResponse, ErrorResponse, dialect

VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
SECURITY_SCHEMES = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "the server's API key"},
    "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
}
_MIDDLEWARE_STATUS = {
    400: "Host not allowed: a server without an API key answers only loopback names, IP "
    "addresses and allowed_hosts",
    401: "Missing or wrong API key",
    413: "The request body is larger than max_body_bytes",
}


def event_stream(
    *data: type[BaseModel], error: type[BaseModel] = ErrorResponse, done: bool = True
) -> dict[int | str, dict[str, Any]]:
    """A `responses=` entry for a route that streams (`stream: true`): its 200 is also
    `text/event-stream`. Each event's `data` is JSON of one of the `data` models, or
    an `error` object after a failure mid-stream, or (`done`) the final `[DONE]`.

    In OpenAPI 3.1 the schema of a text/event-stream describes one event, as
    {event, data, id, retry}; `data` is a string whose JSON content is stated with
    contentMediaType / contentSchema (the models inlined: they need no components).
    """
    payload = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [inline_schema(model) for model in (*data, error)]},
    }
    names = ", ".join(model.__name__ for model in data)
    description = f"One server-sent event: `data` holds JSON ({names}, or an error object)"
    if done:
        payload = {"anyOf": [{"const": "[DONE]"}, payload]}
        description += "; the last event's data is [DONE]"
    schema = {
        "type": "object",
        "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "data": payload},
        "required": ["data"],
        "description": description,
    }
    return {200: {"content": {"text/event-stream": {"schema": schema}}}}


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema as it serializes, with its $defs written in place."""
    schema = model.model_json_schema(mode="serialization")
    definitions = schema.pop("$defs", {})

    def resolve(node: Any, seen: frozenset[str]) -> Any:
        if isinstance(node, list):
            return [resolve(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise ValueError(f"{model.__name__} is recursive ({name}): it cannot be inlined")
            rest = {key: value for key, value in node.items() if key != "$ref"}
            return {**resolve(definitions[name], seen | {name}), **resolve(rest, seen)}
        return {key: resolve(value, seen) for key, value in node.items()}

    return resolve(schema, frozenset())


def install_openapi(
    app: FastAPI, *, api_key: bool, host_check: bool, open_paths: Iterable[str]
) -> None:
    """Replace `app.openapi` with one that finishes FastAPI's document (see above)."""
    build: Callable[[], dict[str, Any]] = app.openapi
    open_set = frozenset(open_paths)
    finished = False

    def openapi() -> dict[str, Any]:
        nonlocal finished
        document = build()  # FastAPI caches it in app.openapi_schema: finished in place
        if not finished:
            finish_document(document, api_key=api_key, host_check=host_check, open_paths=open_set)
            finished = True
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def finish_document(
    document: dict[str, Any], *, api_key: bool, host_check: bool, open_paths: frozenset[str]
) -> None:
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for path, operations in document.get("paths", {}).items():
        error_ref = _component(schemas, _error_model(path))
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            statuses = [413]
            if host_check:
                statuses.append(400)
            if api_key and path not in open_paths:
                statuses.append(401)
                operation["security"] = [{name: []} for name in SECURITY_SCHEMES]
            for status in statuses:
                responses.setdefault(
                    str(status),
                    {
                        "description": _MIDDLEWARE_STATUS[status],
                        "content": {"application/json": {"schema": {"$ref": error_ref}}},
                    },
                )
            operation["responses"] = dict(sorted(responses.items()))
    _integer_bounds(document)
    for name in VALIDATION_SCHEMAS:  # HTTPValidationError first: it refers to the other
        if f'"#/components/schemas/{name}"' not in json.dumps(document):
            schemas.pop(name, None)
    if api_key:
        document["components"]["securitySchemes"] = SECURITY_SCHEMES


def _integer_bounds(node: Any) -> None:
    """Bounds of integer schemas as integers: FastAPI writes them as doubles (1.0), and
    a double is not exact past 2**53, where 64-bit seeds end."""
    if isinstance(node, list):
        for item in node:
            _integer_bounds(item)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                value = node.get(key)
                if isinstance(value, float) and value.is_integer():
                    node[key] = int(value)
        for value in node.values():
            _integer_bounds(value)


def _error_model(path: str) -> type[BaseModel]:
    return AnthropicErrorResponse if dialect(path) == "anthropic" else ErrorResponse


def _component(schemas: dict[str, Any], model: type[BaseModel]) -> str:
    """Add `model` (and the models it uses) to the components; its $ref."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault(model.__name__, schema)
    return f"#/components/schemas/{model.__name__}"
