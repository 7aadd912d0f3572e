"""Errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) for every route:
raised as APIError by the handlers, or mapped here from the engine's and the validator's errors."""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.client import ContextLengthError, EngineDeadError, EngineOverloadedError
from engine.errors import parameter_of
from server.limits import TooManyRequestsError
from server.replies import error_body


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


# OpenAI's error types as Anthropic names them, for /v1/messages (server/anthropic_api.py).
ANTHROPIC_TYPES = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
                   "permission_error": "permission_error", "NotFoundError": "not_found_error",
                   "rate_limit_error": "rate_limit_error", "service_unavailable": "overloaded_error"}


def shaped(path: str, message: str, type_: str, param: str | None = None, code=None) -> dict:
    """An error body in the shape of the API a request to `path` speaks: Anthropic's on /v1/messages,
    else OpenAI's."""
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(type_, "api_error"), "message": message}}
    return error_body(message, type_, param, code)


async def _api_error(request: Request, e: APIError):
    return JSONResponse(shaped(request.url.path, e.message, e.type, e.param, e.code), status_code=e.status,
                        headers={"Retry-After": "5"} if e.status == 503 else None)


async def _validation_error(request: Request, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", "?"))[-1]
        return JSONResponse(shaped(request.url.path, f"The request body is not valid JSON (error at character {where}: "
                                       f"{first.get('ctx', {}).get('error', 'parse error')}).",
                                       "invalid_request_error"), status_code=400)
    kind = request.headers.get("content-type", "")
    if tuple(first.get("loc", ())) == ("body",) and "json" not in kind:  # the body was never read as JSON
        return JSONResponse(shaped(request.url.path, f"The request body must be JSON, sent with Content-Type: "
                                   f"application/json (this request's Content-Type: {kind or 'none'}).",
                                   "invalid_request_error"), status_code=400)
    errors = readable(e.errors())
    msg = "; ".join(f"{path or 'body'}: {text}" for path, text in errors[:5])
    return JSONResponse(shaped(request.url.path, msg or "invalid request", "invalid_request_error",
                               (errors[0][0] or None) if errors else None), status_code=400)


UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list|dict)$|\[")  # pydantic's names for a union's branches


def readable(errors: list[dict]) -> list[tuple[str, str]]:
    """(path, message) of each validation error as a caller reads it. A value that fits no branch of a
    union (`content: str | list[part]`) gets an error from every branch, each path tagged with its
    branch's type: the tags leave the paths, and a branch's error whose path another one's extends
    (the value was a list, so "should be a valid string" says nothing) is left out."""
    found = []
    for err in errors:
        path = ".".join(str(p) for p in err.get("loc", ())[1:] if not (isinstance(p, str) and UNION_BRANCH.search(p)))
        text = str(err.get("msg", "")).removeprefix("Value error, ")
        path = path or parameter_of(err.get("ctx", {}).get("error")) or ""  # a check of the whole body names its field
        if (path, text) not in found:
            found.append((path, text))
    return [(path, text) for path, text in found
            if not any(other.startswith(path + ".") for other, _ in found)]


async def _context_length(request: Request, e: ContextLengthError):
    param = "messages" if e.parameter == "prompt" and request.url.path.endswith("chat/completions") else e.parameter
    return JSONResponse(shaped(request.url.path, str(e), "invalid_request_error", param), status_code=400)


async def _overloaded(request: Request, e: EngineOverloadedError):
    return JSONResponse(shaped(request.url.path, str(e), "service_unavailable", code="overloaded"), status_code=503,
                        headers={"Retry-After": "1"})


async def _too_many(request: Request, e: TooManyRequestsError):
    return JSONResponse(shaped(request.url.path, str(e), "rate_limit_error", code="rate_limit_exceeded"),
                        status_code=429,
                        headers={"Retry-After": str(e.retry_after)})


async def _dead(request: Request, e: EngineDeadError):
    return JSONResponse(shaped(request.url.path, str(e), "service_unavailable"), status_code=503,
                        headers={"Retry-After": "5"})


async def _http_error(request: Request, e: StarletteHTTPException):
    """404 and 405 in OpenAI's shape too, and FastAPI's 400 for a body it could not decode."""
    message = {404: f"No route {request.url.path}.",
               405: f"{request.method} is not allowed on {request.url.path}."}.get(e.status_code, str(e.detail))
    if e.status_code == 400 and e.detail == "There was an error parsing the body":  # e.g. bytes that are not UTF-8
        message = "The request body could not be read as JSON: it must be UTF-8 text."
    return JSONResponse(shaped(request.url.path, message, "invalid_request_error"), status_code=e.status_code,
                        headers=getattr(e, "headers", None))


async def _invalid(request: Request, e: ValueError):
    return JSONResponse(shaped(request.url.path, str(e), "invalid_request_error", parameter_of(e)), status_code=400)


ERROR_HANDLERS = {APIError: _api_error, RequestValidationError: _validation_error, StarletteHTTPException: _http_error,
                  ContextLengthError: _context_length, EngineOverloadedError: _overloaded, EngineDeadError: _dead,
                  TooManyRequestsError: _too_many,
                  ValueError: _invalid}


def install_error_handlers(app: FastAPI) -> None:
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
