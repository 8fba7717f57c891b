"""OpenAI error objects and the exception handlers that produce them.

Every 4xx/5xx body is `{"error": {"message", "type", "param", "code"}}`.

Validation errors (malformed JSON, wrong types, missing or unknown fields'
values) answer 400 `invalid_request_error`, as the OpenAI API does, not
FastAPI's default 422: the openai SDK then raises BadRequestError for every
bad request, the same as against api.openai.com.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, field_validator
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


log = logging.getLogger(__name__)

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
    ):
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.detail, self.headers)

    def body_json(self) -> str:
        """The error object as JSON text: the data of an SSE error event mid-stream."""
        return ErrorResponse(error=self.detail).model_dump_json()


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


def model_not_found(name: str) -> APIError:
    return APIError(
        404,
        f"The model '{name}' does not exist. This server serves one model; see GET /v1/models.",
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


def error_response(
    status: int, detail: ErrorDetail, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.add_exception_handler(EngineNotReadyError, _engine_not_ready)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error_response(exc.errors(), request.headers.get("content-type"))


def validation_error_response(
    errors: Sequence[Any], content_type: str | None = None
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
        return error_response(400, detail)
    if first.get("type") == "model_attributes_type" and _param(first) is None:
        # The body was not parsed as JSON at all, e.g. curl -d without a JSON content type.
        detail = ErrorDetail(
            message="The request body must be a JSON object "
            f"(Content-Type: application/json; got {content_type or 'none'}).",
            type=INVALID_REQUEST,
            code="invalid_json",
        )
        return error_response(400, detail)
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
    return error_response(400, detail)


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _is_branch(part: Any) -> bool:
    """pydantic names the member of a union it tried in `loc`: 'str', 'list[str]', ..."""
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "dict", "list", "none"}
        or "[" in part
        or part.startswith("function-")
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
    elif status == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    detail = ErrorDetail(
        message=message,
        type=INVALID_REQUEST if status < 500 else SERVER_ERROR,
        code=codes.get(status),
    )
    return error_response(status, detail, getattr(exc, "headers", None))


async def _queue_full(request: Request, exc: Exception) -> JSONResponse:
    detail = ErrorDetail(
        message=f"The server is busy ({exc}); retry later.",
        type="rate_limit_error",
        code="queue_full",
    )
    return error_response(429, detail, {"Retry-After": RETRY_AFTER_S})


async def _engine_not_ready(request: Request, exc: Exception) -> JSONResponse:
    engine = request.app.state.engine
    return not_ready(engine.state, engine.load_error).response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Reached only by a bug: bad input is answered before this. Log the traceback
    # here; the client gets the one-line reason.
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    detail = ErrorDetail(
        message=f"Internal server error: {type(exc).__name__}: {exc}",
        type=SERVER_ERROR,
        code="internal_error",
    )
    return error_response(500, detail)
