"""The Starlette application: routes, error handling, and the engine link's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from frontend import admin, embeddings_api, openai_api, responses_api, tokenize_api
from frontend.body_limit import BodyLimit
from frontend.engine_client import EngineClient
from frontend.engines import EngineGroup
from frontend.errors import APIError
from frontend.responses_store import ResponseStore, parse_spec
from frontend.sse import StreamWatchdog
from frontend.state import AppState
from protocol.config import FrontendConfig
from protocol.curve import CurveKeys

log = logging.getLogger("sluice.frontend")


async def health(request: Request) -> Response:
    """Liveness: the frontend runs and the scheduler and workers answer."""
    state: AppState = request.app.state.sluice
    if state.client.healthy:
        return JSONResponse({"status": "ok"})
    client = state.client
    if not client.scheduler_alive:
        reason = "the scheduler is not answering"
    else:
        reason = client.engine_error or client.unhealthy_reason or "no worker is ready"
    return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)


async def ready(request: Request) -> Response:
    """Readiness: the model is loaded and warmed up, and the engine is healthy."""
    state: AppState = request.app.state.sluice
    if state.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if state.client.model is not None and state.client.healthy:
        state.require_tokenizer()  # built before the first request needs it (once: it is kept)
        return JSONResponse({"status": "ready", "model": state.model_name})
    return JSONResponse({"status": "loading" if state.client.model is None else "unhealthy"}, status_code=503)


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.sluice
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _api_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, APIError):
        raise exc
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, HTTPException):
        raise exc
    if exc.status_code == 404:
        return APIError(404, f"no route {request.method} {request.url.path}", code="not_found").response()
    if exc.status_code == 405:
        return APIError(405, f"method {request.method} not allowed on {request.url.path}").response()
    return APIError(exc.status_code, str(exc.detail)).response()


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    # Starlette re-raises after this handler so the server logs the traceback; just shape the body.
    return APIError(500, "internal server error").response()


class SluiceApp(Starlette):
    """Starlette, keeping the server's own ``send`` in each request's scope (``sluice.send``):
    a stream writes its chunks with it, past the middlewares' wrappers (three coroutine frames
    per chunk otherwise). Its response start goes through them, so they know it started."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["sluice.send"] = send
        await super().__call__(scope, receive, send)


def build_app(config: FrontendConfig, client: EngineClient | None = None) -> Starlette:
    """The HTTP app over the engines ``config.address`` lists (or over ``client``, a test's)."""
    curve = CurveKeys.load(config.curve_keys, server=False)
    engine = EngineGroup([client]) if client is not None else EngineGroup.connect(config.addresses, curve)
    store_path = parse_spec(config.responses_store)
    state = AppState(config, engine, ResponseStore(store_path) if store_path is not None else None)

    watchdog = StreamWatchdog(lambda: (h.output for h in engine.handles), config.client_stall_timeout,
                              config.sse_keepalive)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        watching = asyncio.create_task(watchdog.run(), name="stall-watchdog")
        try:
            yield
        finally:
            watching.cancel()
            await engine.close()
            if state.responses is not None:
                state.responses.close()

    routes = [
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings_api.embeddings, methods=["POST"]),
        Route("/v1/responses", responses_api.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_api.delete_response, methods=["DELETE"]),
        Route("/v1/models", openai_api.list_models, methods=["GET"]),
        Route("/tokenize", tokenize_api.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize_api.detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenize_api.tokenizer_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *admin.ROUTES,
    ]
    app = SluiceApp(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected_error},
        middleware=[Middleware(BodyLimit, limit=config.max_request_body)],
    )
    app.state.sluice = state
    return app
