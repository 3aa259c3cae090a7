"""The FastAPI application factory and the per-request context (request id, metrics, log line, 500s).

``create_app(settings)`` returns an app that starts loading the model in the background when its lifespan
starts; ``/health`` answers at once, ``/ready`` and the decision routes answer 503 until the model is
loaded and warmed.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clef_runtime.protocol.decisions import DecisionsRequest
from clef_runtime.protocol.images import add_image_fields
from clef_runtime.protocol.openai_chat import ChatCompletionRequest
from clef_runtime.protocol.openai_responses import ResponsesRequest
from clef_runtime.protocol.systemone import SystemOneRequest
from clef_runtime.server.classifiers import open_store as open_classifier_store
from clef_runtime.server.compression import CompressionMiddleware
from clef_runtime.server.errors import error_body, install_error_handlers
from clef_runtime.server.handling import RATE_LIMIT_HEADERS_STATE
from clef_runtime.server.jobs import JobsService
from clef_runtime.server.mcp_http import McpEndpoint
from clef_runtime.server.metrics import ServerMetrics
from clef_runtime.server.openai_errors import openai_shaped_paths
from clef_runtime.server.openapi_docs import CLASSIFIERS_AND_MCP_DESCRIPTION
from clef_runtime.server.routes_chat import router as chat_router
from clef_runtime.server.routes_classifiers import router as classifiers_router
from clef_runtime.server.routes_decisions import router as decisions_router
from clef_runtime.server.routes_heads import router as heads_router
from clef_runtime.server.routes_info import router as info_router
from clef_runtime.server.routes_jobs import router as jobs_router
from clef_runtime.server.routes_pages import router as pages_router
from clef_runtime.server.routes_responses import router as responses_router
from clef_runtime.server.routes_systemone import router as systemone_router
from clef_runtime.server.routes_workers_ai import router as workers_ai_router
from clef_runtime.server.runtime import DispatcherFactory, EngineFactory, ServerRuntime, load_clef
from clef_runtime.server.settings import ServerSettings
from clef_runtime.version import __version__

__all__ = ["RequestContextMiddleware", "create_app"]

logger = logging.getLogger("clef_runtime.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# /status.json is polled by the status page every few seconds.
_QUIET_ROUTES = frozenset({"/health", "/ready", "/metrics", "/status.json"})

_DESCRIPTION = """\
Clef decision models behind the **System One** API (`POST /v1/systemone`, the API of TypeSafe's Jev),
its OpenAI-shaped sibling (`POST /v1/decisions`), OpenAI structured outputs (`POST /v1/chat/completions`
with a JSON schema, and OpenAI's Responses API, `POST /v1/responses`) and Cloudflare Workers AI's route
(`POST /client/v4/accounts/{id}/ai/run/@cf/cloudflare/clef-flash`).

Request bodies may be compressed with `Content-Encoding: zstd`, `gzip` or `deflate`; responses of at least
1 KiB are compressed by `Accept-Encoding` (zstd or gzip). With API keys
configured, send `Authorization: Bearer <key>` or `X-API-Key: <key>`. Every response carries `x-request-id`.
"""


class RequestContextMiddleware:
    """Pure ASGI middleware: a request id on every response, metrics, one log line per request, and a
    500 body naming the request id for any unhandled exception."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: ServerMetrics,
        route_paths: frozenset[str] = frozenset(),
        send_request_id: bool = True,
    ) -> None:
        self.app = app
        self.metrics = metrics
        # False behind a proxy that puts the request's id on the response itself (Ray Serve's proxy, which
        # also hands the id to this app in the request's x-request-id): a second header would repeat it.
        self.send_request_id = send_request_id
        # Metrics are labelled by route template: a known path, or the template of the matched route (the
        # Workers AI route has path parameters), never the raw path of an unknown URL.
        self.route_paths = route_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        incoming = _header(scope, b"x-request-id")
        request_id = incoming if incoming and _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["started_at"] = started
        status: list[int] = []

        async def send_with_context(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                headers = MutableHeaders(scope=message)
                if self.send_request_id:
                    headers["x-request-id"] = request_id
                # The official SDKs surface this header in their errors.
                headers["x-typesafe-request-id"] = request_id
                headers["x-latency-ms"] = f"{(time.perf_counter() - started) * 1000:.1f}"
                # The caller's rate-limit state, on every response of a request that was admitted.
                for name, value in state.get(RATE_LIMIT_HEADERS_STATE, {}).items():
                    headers.setdefault(name, value)
            await send(message)

        self.metrics.inflight.inc()
        try:
            await self.app(scope, receive, send_with_context)
        except Exception:
            logger.exception("request_id=%s internal error", request_id)
            if not status:
                body = error_body(
                    "internal_error",
                    f"internal server error; quote request id {request_id} when reporting it",
                    request_id=request_id,
                )
                await JSONResponse(body, status_code=500)(scope, receive, send_with_context)
        finally:
            self.metrics.inflight.dec()
            elapsed = time.perf_counter() - started
            path = scope.get("path", "")
            # a route template such as /v1/jobs/{job_id} (path_format: without any {name:convertor} suffix)
            matched = getattr(scope.get("route"), "path_format", None)
            label = matched if isinstance(matched, str) else path if path in self.route_paths else "unmatched"
            code = status[0] if status else 500
            self.metrics.observe_request(label, scope.get("method", ""), code, elapsed)
            _log_request(scope, state, label, code, elapsed)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            decoded: str = value.decode("latin-1")  # ASGI header values are bytes
            return decoded
    return None


def _log_request(scope: Scope, state: dict[str, Any], route: str, status: int, elapsed: float) -> None:
    level = logging.DEBUG if route in _QUIET_ROUTES and status < 400 else logging.INFO
    if not logger.isEnabledFor(level):
        return
    parts = [
        f"request_id={state.get('request_id')}",
        f"{scope.get('method')} {scope.get('path')}",
        f"status={status}",
        f"ms={elapsed * 1000:.1f}",
    ]
    for key in (
        "key",
        "head",
        "input_tokens",
        "questions",
        "truncated_state_tokens",
        "state_cache",
        "steps",
        "error_type",
    ):
        if key in state:
            parts.append(f"{key}={state[key]}")
    logger.log(level, " ".join(parts))


def _install_openapi(app: FastAPI) -> None:
    """Publish the request schemas that the routes validate by hand (they read raw bodies to support
    compression and limits, so FastAPI cannot infer them)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        ref_template = "#/components/schemas/{model}"
        for model in (SystemOneRequest, DecisionsRequest, ChatCompletionRequest, ResponsesRequest):
            model_schema = model.model_json_schema(ref_template=ref_template)
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        # The images are taken out of the body by hand (each error names its image): publish their shapes.
        components.update(add_image_fields(components[SystemOneRequest.__name__], ref_template))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: ServerSettings,
    *,
    engine_factory: EngineFactory | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    dispatcher_factory: DispatcherFactory | None = None,
    send_request_id: bool = True,
) -> FastAPI:
    """Build the server application.

    ``engine_factory(settings)`` loads the engine (default: ``Clef.load(settings.model, ...)``); it runs on
    a background thread when the app's lifespan starts. ``dispatcher_factory`` replaces the local engine loop
    (scale-out: requests go to model replicas). ``on_fatal(exc)`` is called if loading fails (the
    CLI uses it to stop the process with a non-zero status). ``send_request_id=False`` leaves the
    ``x-request-id`` response header to a proxy in front that sets it (Ray Serve's). Returns the FastAPI
    app; its ``state`` holds ``settings``, ``runtime`` and ``metrics``.
    """
    metrics = ServerMetrics()
    runtime = ServerRuntime(
        settings,
        engine_factory or load_clef,
        metrics,
        on_fatal=on_fatal,
        dispatcher_factory=dispatcher_factory,
    )
    # Opened now, so a damaged or foreign jobs or classifiers database stops the server before it listens.
    classifiers = open_classifier_store(settings)
    try:
        jobs = JobsService.open(settings, runtime) if settings.jobs else None
    except BaseException:
        classifiers.close()
        raise
    mcp = McpEndpoint(settings)  # POST /mcp: the decide tool over MCP, through the same decision flow

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start_loading()
        if jobs is not None:
            jobs.start_when_ready()
        async with mcp.running():
            try:
                yield
            finally:
                # Runs after uvicorn has finished every accepted request. Job lines in flight finish or stay
                # unanswered (resumed after a restart); then the engine loop drains the interactive requests.
                if jobs is not None:
                    await anyio.to_thread.run_sync(jobs.stop)
                await anyio.to_thread.run_sync(runtime.stop)
                classifiers.close()

    app = FastAPI(
        title="clef-runtime",
        version=__version__,
        description=_DESCRIPTION + "\n" + CLASSIFIERS_AND_MCP_DESCRIPTION,
        lifespan=lifespan,
        # routes_pages serves /docs and /redoc with local assets (FastAPI's defaults load them from a CDN).
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.runtime = runtime
    app.state.metrics = metrics
    app.state.jobs = jobs
    app.state.classifiers = classifiers
    install_error_handlers(app, openai_shaped_paths)
    app.include_router(systemone_router)
    app.include_router(decisions_router)
    app.include_router(chat_router)
    app.include_router(responses_router)
    app.include_router(workers_ai_router)
    app.include_router(info_router)
    app.include_router(heads_router)
    app.include_router(jobs_router)
    app.include_router(classifiers_router)
    app.include_router(pages_router)
    app.router.routes.append(mcp.route())
    routers = (
        systemone_router,
        decisions_router,
        chat_router,
        responses_router,
        workers_ai_router,
        info_router,
        heads_router,
        jobs_router,
        classifiers_router,
        pages_router,
    )
    # Included routers show up as opaque entries in app.routes (FastAPI >= 0.16x): read their own routes.
    all_routes = [*app.routes, *(route for router in routers for route in router.routes)]
    route_paths = frozenset(
        path for route in all_routes if isinstance(path := getattr(route, "path", None), str)
    )
    app.add_middleware(
        RequestContextMiddleware, metrics=metrics, route_paths=route_paths, send_request_id=send_request_id
    )
    # Outermost: it sees the final headers and bodies, error responses and the 500 body included.
    app.add_middleware(CompressionMiddleware)
    _install_openapi(app)
    return app
