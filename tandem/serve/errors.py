"""OpenAI-style errors, `{"error": {"message", "type", "param", "code"}}`, on every failure path."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("tandem.serve")

_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
}


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error to answer with `status` and an OpenAI error body naming `param`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_value_error(
    e: ValueError, fields: frozenset[str], rename: dict[str, str] | None = None
) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine; their messages start with the
    field's name ("temperature must be ...", "prompt: 600 tokens is too long")."""
    msg = str(e)
    m = re.match(r"[A-Za-z_]+", msg)
    word = m.group(0) if m else None
    param = (rename or {}).get(word, word)
    if param != word:
        msg = param + msg[len(word) :]
    return APIError(msg, param=param if param in fields else None)


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(f"malformed JSON in the request body: {detail}", code="invalid_json")
    if not loc:
        return APIError(
            "the request body must be a JSON object (send Content-Type: application/json)",
            code="invalid_body",
        )
    # pydantic names the union member tried ("str", "list[int]"): not a place in the body
    where = ".".join(
        str(p) for p in loc if isinstance(p, int) or p.isidentifier() and p not in _TAGS
    )
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    given = err.get("input")
    if isinstance(given, (int, float, str)) and kind != "missing":
        msg += f" (got {given!r:.40})"
    return APIError(f"{where}: {msg}", param=str(loc[0]), code=kind or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(f"internal error: {type(exc).__name__}: {exc}", 500).response()
