"""The FastAPI app: OpenAI routes, health, Prometheus metrics, optional admin routes, API key."""

from __future__ import annotations

import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from tandem import __version__
from tandem.engine.async_llm import AsyncLLM
from tandem.serve.chat import OpenAIServingChat
from tandem.serve.completions import OpenAIServingCompletion
from tandem.serve.errors import APIError, install_error_handlers
from tandem.serve.metrics_exchange import MetricsExchange
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest

_OPEN_PATHS = {"/health", "/metrics", "/version"}  # answered without the API key


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    api_key: str | None = None,
    enable_admin_api: bool = False,
    chat_template: str | None = None,
    retry_after_s: int = 1,
    model_root: str | None = None,
    metrics_exchange: MetricsExchange | None = None,
) -> FastAPI:
    """An app serving `llm` under `served_model_name`. With `api_key` every route but health,
    metrics and version needs `Authorization: Bearer <key>`; the admin routes need a key. With
    `metrics_exchange` (one API server of several) `/metrics` sums the request metrics of all."""
    if enable_admin_api and not api_key:
        raise ValueError("enable_admin_api needs an api_key: admin routes change what is served")
    app = FastAPI(title="tandem", version=__version__, strict_content_type=False)
    install_error_handlers(app)
    completions = OpenAIServingCompletion(llm, served_model_name, retry_after_s)
    chat = OpenAIServingChat(llm, served_model_name, retry_after_s, chat_template=chat_template)
    created = int(time.time())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create(request, raw_request)

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
    if api_key:
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
