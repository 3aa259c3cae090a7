"""The FastAPI application factory: the HTTP core and the list of features, assembled once.

``create_app(settings)`` returns an app that starts loading the model in the background when its lifespan
starts; ``/health`` answers at once, ``/ready`` and the decision routes answer 503 until the model is
loaded and warmed. This module is the one place that knows every feature (`FEATURES`); each brings its
router and, where it needs one, a hook that opens what it owns (`clef_runtime.server.feature.Feature`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, ExitStack, asynccontextmanager

import anyio
from fastapi import FastAPI, Request

from clef_runtime.server.classifiers.routes import FEATURE as CLASSIFIERS
from clef_runtime.server.compression import CompressionMiddleware
from clef_runtime.server.cors import add_cors
from clef_runtime.server.errors import ErrorShaper, install_error_handlers
from clef_runtime.server.feature import Feature
from clef_runtime.server.jobs.routes import FEATURE as JOBS
from clef_runtime.server.mcp.http import FEATURE as MCP
from clef_runtime.server.metrics import ServerMetrics
from clef_runtime.server.middleware import RequestContextMiddleware
from clef_runtime.server.openai.chat import FEATURE as CHAT
from clef_runtime.server.openai.responses import FEATURE as RESPONSES
from clef_runtime.server.openapi import install_openapi
from clef_runtime.server.pages.routes import FEATURE as PAGES
from clef_runtime.server.routes.decisions import FEATURE as DECISIONS
from clef_runtime.server.routes.heads import FEATURE as HEADS
from clef_runtime.server.routes.info import FEATURE as INFO
from clef_runtime.server.routes.systemone import FEATURE as SYSTEMONE
from clef_runtime.server.routes.workers_ai import FEATURE as WORKERS_AI
from clef_runtime.server.runtime import DispatcherFactory, EngineFactory, ServerRuntime, load_clef
from clef_runtime.server.settings import ServerSettings
from clef_runtime.server.tracing import start_tracing
from clef_runtime.version import __version__

__all__ = ["FEATURES", "create_app"]

logger = logging.getLogger("clef_runtime.server")

FEATURES: tuple[Feature, ...] = (
    SYSTEMONE,
    DECISIONS,
    CHAT,
    RESPONSES,
    WORKERS_AI,
    INFO,
    HEADS,
    JOBS,
    CLASSIFIERS,
    PAGES,
    MCP,
)
"""Every feature, in the order of their routes (and of their OpenAPI description paragraphs)."""

_DESCRIPTION = """\
Clef decision models behind the **System One** API (`POST /v1/systemone`, the API of TypeSafe's Jev),
its OpenAI-shaped sibling (`POST /v1/decisions`), OpenAI structured outputs (`POST /v1/chat/completions`
with a JSON schema, and OpenAI's Responses API, `POST /v1/responses`) and Cloudflare Workers AI's route
(`POST /client/v4/accounts/{id}/ai/run/@cf/cloudflare/clef-flash`).

Request bodies may be compressed with `Content-Encoding: zstd`, `gzip` or `deflate`; responses of at least
1 KiB are compressed by `Accept-Encoding` (zstd or gzip). With API keys
configured, send `Authorization: Bearer <key>` or `X-API-Key: <key>`. Every response carries `x-request-id`.
"""


def _error_shaper(features: tuple[Feature, ...]) -> Callable[[Request, int], ErrorShaper | None]:
    """The first shape a feature claims for a path's HTTP error, or None (the server's own)."""
    shapers = [feature.error_shaper for feature in features if feature.error_shaper is not None]

    def shape(request: Request, status: int) -> ErrorShaper | None:
        for shaper in shapers:
            if (found := shaper(request, status)) is not None:
                return found
        return None

    return shape


def create_app(
    settings: ServerSettings,
    *,
    engine_factory: EngineFactory | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    dispatcher_factory: DispatcherFactory | None = None,
    send_request_id: bool = True,
    features: tuple[Feature, ...] = FEATURES,
) -> FastAPI:
    """Build the server application.

    ``engine_factory(settings)`` loads the engine (default: ``Clef.load(settings.model, ...)``); it runs on
    a background thread when the app's lifespan starts. ``dispatcher_factory`` replaces the local engine loop
    (scale-out: requests go to model replicas). ``on_fatal(exc)`` is called if loading fails (the
    CLI uses it to stop the process with a non-zero status). ``send_request_id=False`` leaves the
    ``x-request-id`` response header to a proxy in front that sets it (Ray Serve's); ``features`` are the
    routes and services it serves (default: all). Returns the FastAPI
    app; its ``state`` holds ``settings``, ``runtime`` and ``metrics``.
    """
    metrics = ServerMetrics()
    tracing = start_tracing(settings.otlp_traces_endpoint, settings.otlp_traces_protocol)
    runtime = ServerRuntime(
        settings,
        engine_factory or load_clef,
        metrics,
        on_fatal=on_fatal,
        dispatcher_factory=dispatcher_factory,
    )
    # What the features open (databases) is closed last, after the server stopped, or at once if one fails.
    resources = ExitStack()
    runs: list[AbstractAsyncContextManager[None]] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime.start_loading()
        try:
            async with AsyncExitStack() as running:
                for run in runs:
                    await running.enter_async_context(run)
                # Left after uvicorn has finished every accepted request: the features stop (job lines in
                # flight finish or stay unanswered, resumed after a restart) before the engine loop drains
                # the interactive requests.
                yield
        finally:
            await anyio.to_thread.run_sync(runtime.stop)
            resources.close()
            if tracing is not None:  # the spans still buffered are exported before the process ends
                await anyio.to_thread.run_sync(tracing.shutdown)

    description = "\n".join(
        [_DESCRIPTION, *(feature.description for feature in features if feature.description)]
    )
    app = FastAPI(
        title="clef-runtime",
        version=__version__,
        description=description,
        lifespan=lifespan,
        # The pages feature serves /docs and /redoc with local assets (FastAPI loads them from a CDN).
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.runtime = runtime
    app.state.metrics = metrics
    install_error_handlers(app, _error_shaper(features))
    with ExitStack() as opening:
        opening.enter_context(resources)  # closes what is open if a feature fails to open
        for feature in features:
            app.include_router(feature.router)
            if feature.attach is not None and (run := feature.attach(app, resources)) is not None:
                runs.append(run)
        opening.pop_all()
    # Included routers show up as opaque entries in app.routes (FastAPI >= 0.16x): read their own routes.
    all_routes = [*app.routes, *(route for feature in features for route in feature.router.routes)]
    route_paths = frozenset(
        path for route in all_routes if isinstance(path := getattr(route, "path", None), str)
    )
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics,
        route_paths=route_paths,
        send_request_id=send_request_id,
        tracing=tracing,
    )
    # Outermost: it sees the final headers and bodies, error responses and the 500 body included.
    app.add_middleware(CompressionMiddleware)
    add_cors(app, settings.cors_origins)
    install_openapi(app, tuple(model for feature in features for model in feature.request_models))
    return app
