"""Error objects and the exception handlers that produce them.

Every 4xx/5xx body is `{"error": {"message", "type", "param", "code"}}` (the
OpenAI shape), except on the Anthropic Messages routes (/v1/messages...), which
answer `{"type": "error", "error": {"type", "message"}}` with Anthropic's error
types. The request path alone decides the shape (`dialect`), in one place
(`error_body`) that every handler and every middleware answering an error goes
through, so no call site picks a shape itself.

Validation errors (malformed JSON, wrong types, missing or unknown fields'
values) answer 400 `invalid_request_error`, as the OpenAI API does, not
FastAPI's default 422: the openai SDK then raises BadRequestError for every
bad request, the same as against api.openai.com.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashserve.engine.generation.worker import EngineNotReadyError, QueueFullError

MAX_MESSAGE_CHARS = 2000
# How deep a request body's JSON may nest. Real bodies stay far below (a JSON
# schema in a tool is a few levels per schema level); deeper ones exist to
# exhaust the recursion of whatever walks them next.
MAX_JSON_DEPTH = 64


class ErrorDetail(BaseModel):
    """The error object every route answers with (the OpenAI shape)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None

    @field_validator("message", "param")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        # Messages quote the request (a model name, a field's key). JSON may carry
        # lone surrogates (\ud800) that UTF-8 cannot encode: write them as escapes,
        # or the response itself would fail. Long quotes are cut.
        if value is None:
            return None
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value if len(value) <= MAX_MESSAGE_CHARS else value[:MAX_MESSAGE_CHARS] + "..."


class ErrorResponse(BaseModel):
    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str = Field(
        description="invalid_request_error | authentication_error | permission_error | "
        "not_found_error | request_too_large | rate_limit_error | api_error | overloaded_error"
    )
    message: str


class AnthropicErrorResponse(BaseModel):
    """The error object of the Anthropic Messages routes."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


ANTHROPIC_PATH = "/v1/messages"
# Anthropic's error type for each status it documents; 503 (loading, shutting
# down) is the server being unable to take the request now: overloaded_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def dialect(path: str) -> Literal["openai", "anthropic"]:
    """The API dialect whose error shape a request path answers with."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return "anthropic"
    return "openai"


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(
    status: int, detail: ErrorDetail, path: str = "", anthropic_message: str | None = None
) -> dict[str, Any]:
    """The error object for `path`'s dialect: the one place the shape is chosen.
    `anthropic_message`: Anthropic's own wording, where clients match it."""
    if dialect(path) == "anthropic":
        message = anthropic_message or detail.message
        if detail.param and detail.param not in message and anthropic_message is None:
            # Anthropic's object has no `param`: name the field as its messages do.
            message = f"{detail.param}: {message}"
        error = AnthropicErrorDetail(type=anthropic_error_type(status), message=message)
        return AnthropicErrorResponse(error=error).model_dump()
    return ErrorResponse(error=detail).model_dump()


log = logging.getLogger(__name__)

_STATUS_MEANING = {
    400: "The request is invalid (an error object names the field)",
    401: "Missing or wrong API key",
    404: "Unknown model, route or stored object",
    413: "The request body is larger than max_body_bytes",
    429: "The queue is full; retry after Retry-After seconds",
    503: "The model is loading or failed to load, or the server is shutting down",
}


def error_responses(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries for the error statuses a route answers with."""
    return {
        status: {"model": model, "description": _STATUS_MEANING.get(status, "Error")}
        for status in statuses
    }


INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
RETRY_AFTER_S = "1"


class APIError(Exception):
    """An error the client gets as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        anthropic_message: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers
        self.anthropic_message = anthropic_message

    def response(self, path: str = "") -> JSONResponse:
        body = error_body(self.status, self.detail, path, self.anthropic_message)
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def body_json(self, path: str = "") -> str:
        """The error object as JSON text: the data of an SSE error event mid-stream."""
        return json.dumps(error_body(self.status, self.detail, path, self.anthropic_message))


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def too_deep_message() -> str:
    return f"The request body is nested deeper than {MAX_JSON_DEPTH} levels."


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON data nests containers more than `limit` deep (without recursing)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        elif not isinstance(item, list):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return False


class DepthLimited(BaseModel):
    """A request body: checked for depth before any field is read, because later
    steps (templates, schemas, dumps) recurse, and fields not declared are walked
    by whatever reads the body next."""

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, data: Any) -> Any:
        if nested_deeper_than(data, MAX_JSON_DEPTH):
            raise ValueError(too_deep_message())
        return data


def model_not_found(name: str) -> APIError:
    return APIError(
        404,
        f"The model '{name}' does not exist on this server; see GET /v1/models.",
        param="model",
        code="model_not_found",
    )


def not_ready(state: str, load_error: str | None = None) -> APIError:
    if state == "loading":
        message = "The model is still loading; retry shortly."
    else:
        message = f"The model is not available ({state})" + (
            f": {load_error}" if load_error else ""
        )
    return APIError(
        503,
        message,
        type=SERVER_ERROR,
        code="model_not_ready",
        headers={"Retry-After": RETRY_AFTER_S} if state == "loading" else None,
    )


def model_unavailable(message: str, transient: bool = False) -> APIError:
    """A model that could not be loaded (a damaged file, no room) or, `transient`,
    not now (every loaded model busy under models_max)."""
    return APIError(
        503,
        message,
        type=SERVER_ERROR,
        code="model_unavailable",
        headers={"Retry-After": RETRY_AFTER_S} if transient else None,
    )


def error_response(
    status: int, detail: ErrorDetail, headers: dict[str, str] | None = None, *, path: str = ""
) -> JSONResponse:
    """The error response to a request for `path` (its dialect picks the shape)."""
    return JSONResponse(error_body(status, detail, path), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.add_exception_handler(EngineNotReadyError, _engine_not_ready)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request.url.path)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error_response(
        exc.errors(), request.headers.get("content-type"), request.url.path
    )


def validation_error_response(
    errors: Sequence[Any], content_type: str | None = None, path: str = ""
) -> JSONResponse:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        position = first["loc"][-1] if first.get("loc") else "?"
        detail = ErrorDetail(
            message=f"Could not parse the JSON body of the request: {reason} (at character "
            f"{position}).",
            type=INVALID_REQUEST,
            code="invalid_json",
        )
        return error_response(400, detail, path=path)
    if first.get("type") == "model_attributes_type" and _param(first) is None:
        # The body was not parsed as JSON at all, e.g. curl -d without a JSON content type.
        detail = ErrorDetail(
            message="The request body must be a JSON object "
            f"(Content-Type: application/json; got {content_type or 'none'}).",
            type=INVALID_REQUEST,
            code="invalid_json",
        )
        return error_response(400, detail, path=path)
    errors = _most_relevant(errors)
    messages = list(dict.fromkeys(_describe(err) for err in errors))
    if len(messages) > 5:
        messages = [*messages[:5], f"... and {len(messages) - 5} more"]
    detail = ErrorDetail(
        message="Invalid request: " + "; ".join(messages),
        type=INVALID_REQUEST,
        param=_param(errors[0]) if errors else None,
        code=_code(errors[0]) if errors else None,
    )
    return error_response(400, detail, path=path)


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _is_branch(part: Any) -> bool:
    """pydantic names the member of a union it tried in `loc`: 'str', 'list[str]', ..."""
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "dict", "list", "none"}
        or "[" in part
        or part.startswith(("function-", "constrained-"))  # constrained: Field(min_length=1)
    )


def _param(err: Any) -> str | None:
    """('body', 'messages', 0, 'user', 'content', 'str') -> 'messages.0.content'."""
    parts: list[str] = []
    previous: Any = None
    for part in err.get("loc", ()):
        # Drop the body prefix, union members, and the role tag of a message.
        skip = part == "body" and not parts
        skip = skip or _is_branch(part) or (isinstance(previous, int) and part in _ROLES)
        if not skip:
            parts.append(str(part))
        previous = part
    if err.get("type") == "union_tag_invalid":
        # An unknown role: name the field that selects the message type.
        parts.append(str((err.get("ctx") or {}).get("discriminator", "")).strip("'\""))
    return ".".join(p for p in parts if p) or None


def _most_relevant(errors: Sequence[Any]) -> list[Any]:
    """For a field given as a union (content: str | list of parts), a wrong part inside
    the list also fails the 'str' member; report the part, not 'should be a string'."""

    def type_error_of_branch(err: Any) -> bool:
        return str(err.get("type", "")).endswith("_type") and any(
            _is_branch(p) for p in err.get("loc", ())
        )

    kept = []
    for err in errors:
        param = _param(err) or ""
        if type_error_of_branch(err) and any(
            not type_error_of_branch(other) and (_param(other) or "").startswith(param)
            for other in errors
            if other is not err
        ):
            continue
        kept.append(err)
    return kept


def _describe(err: Any) -> str:
    param = _param(err)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "missing":
        return f"'{param}' is required" if param else "a required field is missing"
    return f"{param}: {msg}" if param else msg


def _code(err: Any) -> str:
    kind = str(err.get("type", ""))
    if kind == "missing":
        return "missing_required_parameter"
    if kind.endswith(("_type", "_parsing")):
        return "invalid_type"
    return "invalid_value"


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    message = str(exc.detail)
    if isinstance(exc.__cause__, RecursionError):
        # FastAPI's json.loads gave up on a body nested past Python's recursion limit.
        message = too_deep_message()
    elif isinstance(exc.__cause__, ValueError) and "integer string" in str(exc.__cause__):
        # json.loads refuses integer literals past sys.get_int_max_str_digits().
        message = "A number in the JSON body has too many digits."
    if status == 404 and message == "Not Found":
        message = f"Unknown route: {request.method} {request.url.path}"
    headers = getattr(exc, "headers", None)
    if status == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
        headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request))}
    detail = ErrorDetail(
        message=message,
        type=INVALID_REQUEST if status < 500 else SERVER_ERROR,
        code=codes.get(status),
    )
    return error_response(status, detail, headers, path=request.url.path)


def allowed_methods(request: Request) -> list[str]:
    """Every method the app's routes take for this path. Starlette's 405 names only
    the first route that matched it (GET and DELETE /v1/responses/{id} are two)."""
    methods: set[str] = set()
    stack = list(request.app.router.routes)
    while stack:
        route = stack.pop()
        contexts = getattr(route, "effective_route_contexts", None)  # included routers
        if callable(contexts):
            stack.extend(contexts())
        regex = getattr(route, "path_regex", None)
        if regex is not None and regex.match(request.url.path):
            methods.update(getattr(route, "methods", None) or ())
    return sorted(methods)


async def _queue_full(request: Request, exc: Exception) -> JSONResponse:
    detail = ErrorDetail(
        message=f"The server is busy ({exc}); retry later.",
        type="rate_limit_error",
        code="queue_full",
    )
    return error_response(429, detail, {"Retry-After": RETRY_AFTER_S}, path=request.url.path)


async def _engine_not_ready(request: Request, exc: Exception) -> JSONResponse:
    # The engine says "model is <state>", or why its model failed to load.
    reason = str(exc) or "model is loading"
    if reason.startswith("model is "):
        return not_ready(reason.removeprefix("model is ")).response(request.url.path)
    return not_ready("failed", reason).response(request.url.path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Reached only by a bug: bad input is answered before this. Log the traceback
    # here; the client gets the one-line reason.
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    detail = ErrorDetail(
        message=f"Internal server error: {type(exc).__name__}: {exc}",
        type=SERVER_ERROR,
        code="internal_error",
    )
    return error_response(500, detail, path=request.url.path)
