"""The FastAPI app: OpenAI routes, health, Prometheus metrics, optional admin routes, API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.routing import Route

from tandem import __version__
from tandem.engine.async_llm import AsyncLLM
from tandem.serve.chat import OpenAIServingChat
from tandem.serve.completions import OpenAIServingCompletion
from tandem.serve.errors import APIError, install_error_handlers
from tandem.serve.metrics_exchange import MetricsExchange
from tandem.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.serve.tokenization import OpenAIServingTokenization

_OPEN_PATHS = {"/health", "/metrics", "/version"}  # answered without the API key
# Bodies of any size, sized by the model and behind the admin key: a checkpoint's bytes.
_UNLIMITED_BODY_PATHS = {"/update_weights"}
DEFAULT_MAX_BODY_BYTES = 32 << 20
_DRAIN_BYTES, _DRAIN_S = 64 << 20, 5.0  # what a refused body may still send, dropped unread


def _direct_route(path: str, model: type, create) -> Route:
    """POST `path` as a plain Starlette route: the body read, parsed and validated as FastAPI
    does it for a route taking `model` (JSON without a content type or with a JSON one; a JSON
    error, a missing body or a bad field raise the same RequestValidationError, so the error
    handlers answer alike), then `create(request, raw_request)`. In a burst of requests FastAPI's
    handler around the endpoint (dependency solving, body-to-arguments) took about a fifth of the
    API server's event loop (docs/benchmarks.md): what admission waits on."""

    async def endpoint(raw_request: Request) -> Response:
        data = None
        try:
            body = await raw_request.body()
            if body:
                content_type = raw_request.headers.get("content-type")
                main, _, sub = (content_type or "").split(";", 1)[0].strip().lower().partition("/")
                if content_type and not (main == "application" and (sub == "json" or sub.endswith("+json"))):
                    data = body  # not JSON: validated as the bytes it is (and refused)
                else:
                    data = json.loads(body)
        except json.JSONDecodeError as e:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                           "msg": "JSON decode error", "input": {},
                                           "ctx": {"error": e.msg}}], body=e.doc) from e
        except HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 (FastAPI's answer to a body it cannot read or decode)
            raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
        try:
            request = model.model_validate(data)
        except ValidationError as e:
            errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
            raise RequestValidationError(errors, body=data) from e
        return await create(request, raw_request)

    return Route(path, endpoint, methods=["POST"], include_in_schema=False)


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    enable_admin_api: bool = False,
    chat_template: str | None = None,
    retry_after_s: int = 1,
    model_root: str | None = None,
    metrics_exchange: MetricsExchange | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float | None = None,
) -> FastAPI:
    """An app serving `llm` under `served_model_name`. With `api_key` every route but health,
    metrics and version needs `Authorization: Bearer <key>`; the admin routes need a key. With
    `metrics_exchange` (one API server of several) `/metrics` sums the request metrics of all.
    A request body over `max_body_bytes` is a 413, one that takes over `body_timeout_s` to
    arrive a 408 (/update_weights is exempt: a checkpoint is as large as the model)."""
    if enable_admin_api and not api_key:
        raise ValueError("enable_admin_api needs an api_key: admin routes change what is served")
    app = FastAPI(title="tandem", version=__version__, strict_content_type=False)
    install_error_handlers(app)
    completions = OpenAIServingCompletion(llm, served_model_name, retry_after_s)
    chat = OpenAIServingChat(llm, served_model_name, retry_after_s, chat_template=chat_template)
    tokenization = OpenAIServingTokenization(chat)
    created = int(time.time())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create(request, raw_request)

    # The two generation routes again, first in the router: the same handlers and the same
    # validation errors as the routes above (which stay for the OpenAPI schema), without
    # FastAPI's per-request dependency solving around them (`_direct_route`).
    app.router.routes[:0] = [
        _direct_route("/v1/completions", CompletionRequest, completions.create),
        _direct_route("/v1/chat/completions", ChatCompletionRequest, chat.create),
    ]

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        return await tokenization.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return tokenization.info()

    @app.get("/v1/models")
    async def list_models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "root": model_root or served_model_name,
            "parent": None,
            "max_model_len": llm.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if llm.is_alive else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        metrics = llm.metrics
        if metrics_exchange is not None:
            metrics = metrics_exchange.collect(metrics)
        text = metrics.render(llm.stats, served_model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    if enable_admin_api:
        from tandem.serve.admin import admin_router

        app.include_router(admin_router(llm))
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if api_key:  # outside the body limit: a client without the key is refused before its body
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if metrics_exchange is not None:  # publishing needs the server's loop: its first request
        app.add_middleware(OnFirstRequest, start=lambda: metrics_exchange.start(llm.metrics))
    return app


class OnFirstRequest:
    """Calls `start()` in the server's event loop when the first request comes in."""

    def __init__(self, app, start):
        self.app = app
        self.start = start

    async def __call__(self, scope, receive, send) -> None:
        if self.start is not None:
            start, self.start = self.start, None
            start()
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Checks `Authorization: Bearer <key>` before anything else (a plain ASGI middleware, so
    streaming responses pass through untouched)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    401,
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request's body whole before the app sees it (the app would buffer it anyway):
    over `max_bytes` it is a 413 (at once when Content-Length says so), and one that does not
    arrive within `timeout_s` of the headers a 408, so neither a huge body nor a slow one can hold
    the server's memory or a connection."""

    def __init__(self, app, max_bytes: int, timeout_s: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNLIMITED_BODY_PATHS:
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(self._too_large(int(length)), scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except asyncio.TimeoutError:
            error = APIError(
                f"the request body did not arrive within {self.timeout_s:g} s",
                408,
                code="request_timeout",
            )
            await error.response()(scope, receive, send)
            return
        if body is None:  # the client went away
            return
        if isinstance(body, int):
            await self._refuse(self._too_large(body), scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what comes after the body: a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | int | None:
        """The body; its size so far once that passes the limit; None at a disconnect."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, error: APIError, scope, receive, send) -> None:
        """Read and drop what the client is still sending (a while, up to a cap), then answer: a
        connection closed with unread data is reset before the client reads the answer (and
        once the answer is sent the server reads no more of the body)."""

        async def drain() -> None:
            left = _DRAIN_BYTES
            while left > 0:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                left -= len(message.get("body", b""))

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(drain(), min(self.timeout_s or _DRAIN_S, _DRAIN_S))
        await error.response()(scope, receive, send)

    def _too_large(self, size: int) -> APIError:
        return APIError(
            f"the request body has {size} bytes or more, more than this server accepts "
            f"({self.max_bytes}; tandem serve --max-request-body-mb)",
            413,
            code="request_too_large",
        )
