"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for
anything the client can fix and a 5xx for the server's own faults (``fault``: the one place an
unexpected exception becomes a response and a log line; the ``Gate`` middleware calls it, so the
status a client gets is the status counted and logged)."""

from __future__ import annotations

import json
import logging
import math
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("deimos.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded"}


class _AsciiJSON(JSONResponse):
    """Error bodies may quote client text; ASCII escapes keep even a lone surrogate sendable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True).encode()


class APIError(Exception):
    """An answer with an error status. ``headers``: sent with it (a 503's ``Retry-After``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else
                                       "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return _AsciiJSON(self.body(), status_code=self.status,
                          headers={**headers, **self.headers})


def retry_after(seconds: float) -> dict[str, str]:
    """The ``Retry-After`` header of a 503: whole seconds, at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    e = errors[0]
    if e.get("type") == "json_invalid":
        why = e.get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {why}".rstrip(": "),
                           code="invalid_json")
    if e.get("type") == "model_attributes_type" or e.get("loc") == ("body",):
        return bad_request("the request body must be a JSON object", code="invalid_json")
    # a union reports one error per branch: name the field once, with its first complaint
    param = _loc(tuple(p for p in e.get("loc", ()) if not (isinstance(p, str) and (
        p.startswith(("list[", "str", "int", "float", "bool", "dict[", "function-", "literal["))
        or p in ("TextPart", "NamedToolChoice")))))
    msg = e.get("msg", "invalid value")
    if e.get("type") == "missing":
        return bad_request(f"'{param}' is required", param=param, code="missing_required_parameter")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return bad_request(f"'{param}': {msg}{more}", param=param, code="invalid_value")


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        if message == "There was an error parsing the body":  # FastAPI's words for json.loads
            message = "the request body cannot be parsed (not JSON, or nested too deeply)"
        return APIError(exc.status_code, message).response()


# Frames of a traceback kept in the log: a RecursionError's thousand frames say nothing more.
TRACEBACK_FRAMES = 12


def fault(exc: BaseException, what: str) -> APIError:
    """The error answer to an exception nothing else handled, logged once. A RecursionError is
    a request nested deeper than some parser can follow: the client's to fix (400), logged as
    one line; anything else is a server fault (500) logged with a (bounded) traceback."""
    if isinstance(exc, RecursionError):
        log.warning("%s: nesting too deep (RecursionError)", what)
        return APIError(400, "the request is nested too deeply to process", code="too_deep")
    tb = "".join(traceback.format_exception(exc, limit=-TRACEBACK_FRAMES, chain=False))
    log.error("%s: %s: %s\n%s", what, type(exc).__name__, exc, tb.rstrip())
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                    type="server_error", code="internal_error")
