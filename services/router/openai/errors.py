"""Every failure as an OpenAI error body `{"error": {"message", "type", "param", "code"}}`.

The status comes from the shared taxonomy (`shared.errors.HTTP_STATUS`): bad input 400,
unknown model 404, every worker's queue full 429 (with `Retry-After`), no worker 503 (with
`Retry-After` for a scalable model whose worker did not start in time),
worker failures 502/504; a framework error (405, with its `Allow`) keeps its status and
headers. Request validation (invalid
JSON, missing or wrong-typed fields) is a 400 naming the field, not FastAPI's 422.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.router.openai.protocol_answers import ErrorInfo, ErrorResponse
from shared.errors import ErrorCode, InvalidArgument, NotFound, Overloaded, TandemError, Unavailable

log = logging.getLogger(__name__)
_E = TypeVar("_E", bound=Exception)


class BadRequest(InvalidArgument):
    """Invalid input, naming the offending request field for the client."""

    def __init__(self, message: str, *, param: str | None = None, api_code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.api_code = api_code


class TooManyRequests(Overloaded):
    """Admission control refused the request: every worker that could take it is past its
    queue limit, the router's admission queue refused it, or its API key's token budget is
    spent (`api_code` "rate_limited"). The client should retry after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: int, api_code: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.api_code = api_code


class NoWorkerYet(Unavailable):
    """A scalable model's request waited for a worker to start and none came in time, or too
    many of its requests wait already: 503, and the client should retry after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelNotFound(NotFound):
    def __init__(self, model: str, available: list[str]) -> None:
        super().__init__(f"The model `{model}` does not exist. Available models: {', '.join(available) or 'none'}.")
        self.model = model


class ResponseNotFound(NotFound):
    """No stored response of this id (never stored, `store: false`, or expired), as vLLM's
    server words it; `param` names the field that gave the id."""

    def __init__(self, response_id: str, *, param: str = "response_id") -> None:
        super().__init__(f"Response with id '{response_id}' not found.")
        self.param = param


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_info(error: TandemError) -> ErrorInfo:
    param, code = None, error.code.value
    if isinstance(error, BadRequest):
        param, code = error.param, error.api_code or code
    elif isinstance(error, TooManyRequests):
        code = error.api_code or code
    elif isinstance(error, ModelNotFound):
        param, code = "model", "model_not_found"
    elif isinstance(error, ResponseNotFound):
        param = error.param
    return ErrorInfo(message=error.message, type=error_type(error.http_status), param=param, code=code)


def error_response(status: int, info: ErrorInfo, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


# Pydantic names the member of a union that failed with a location part like "str" or
# "list[int]"; request fields are identifiers, and none is named like a type.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


# A validated type shows as "function-after[_check(), str]" in a union tag: name it "str".
_VALIDATED_TYPE = re.compile(r"function-[a-z]+\[\w+\(\), ([^\]]+)\]")


def _type_name(tag: str) -> str:
    return _VALIDATED_TYPE.sub(r"\1", tag)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS)


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A message a person can act on, and the offending field (dotted path) if any."""
    by_field: dict[str, list[str]] = {}
    union_members: dict[str, list[str]] = {}
    for detail in error.errors():
        kind = detail.get("type")
        location = [part for part in detail.get("loc", ()) if part != "body"]
        if kind == "json_invalid":
            reason = (detail.get("ctx") or {}).get("error", "malformed JSON")
            return f"Invalid JSON in the request body: {reason}", None
        if not location and kind in ("model_attributes_type", "dict_type", "missing"):
            return "The request body must be a JSON object", None
        tag_at = next((i for i, part in enumerate(location) if _is_type_tag(part)), len(location))
        param = ".".join(str(part) for part in location[:tag_at])
        if tag_at < len(location):
            union_members.setdefault(param, []).append(_type_name(str(location[tag_at])))
        message = str(detail.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "extra_forbidden":
            message = "not a field of this endpoint (OpenAI's API nor vLLM's server defines it here)"
        by_field.setdefault(param, []).append(message)
    problems = []
    for param, messages in by_field.items():
        members = list(dict.fromkeys(union_members.get(param, ())))
        if len(members) > 1:
            problems.append(f"{param}: expected one of {', '.join(members)}")
        else:
            problems.extend(f"{param}: {message}" if param else message for message in dict.fromkeys(messages))
    first_param = next(iter(by_field), "") or None
    return "; ".join(problems[:5]), first_param


def tandem_error_response(error: TandemError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if isinstance(error, TooManyRequests | NoWorkerYet) else None
    return error_response(error.http_status, error_info(error), headers)


def install_error_handlers(app: FastAPI, *, on_rejected: Callable[[str, str], None]) -> None:
    """Register the handlers; `on_rejected(path, outcome)` counts requests refused at parsing."""

    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        on_rejected(request.url.path, ErrorCode.INVALID_ARGUMENT.value)
        return error_response(400, ErrorInfo(message=message, type="invalid_request_error", param=param,
                                             code=ErrorCode.INVALID_ARGUMENT.value))

    async def tandem_error(request: Request, error: TandemError) -> JSONResponse:
        return tandem_error_response(error)

    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        # the framework's own headers stay (a 405's `Allow`)
        return error_response(error.status_code, ErrorInfo(message=str(error.detail), type=error_type(error.status_code),
                                                           code=str(error.status_code)), error.headers)

    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, ErrorInfo(message=f"internal error: {type(error).__name__}", type="server_error",
                                             code=ErrorCode.INTERNAL.value))

    _on_error(app, RequestValidationError, invalid_request)
    _on_error(app, TandemError, tandem_error)
    _on_error(app, HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def _on_error(app: FastAPI, kind: type[_E], handler: Callable[[Request, _E], Awaitable[JSONResponse]]) -> None:
    """`app.add_exception_handler(kind, handler)`, typed: Starlette declares every handler as
    taking any `Exception`, and calls the one registered for the error's class (or a base)."""

    async def on_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, kind), error
        return await handler(request, error)

    app.add_exception_handler(kind, on_error)
