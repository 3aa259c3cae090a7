"""The outermost request handling but compression: a request id and a context for every request, metrics,
one log line per request, and a 500 body naming the request id for any unhandled exception."""

from __future__ import annotations

import logging
import re
import time
import uuid

from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clef_runtime.server.asgi import HttpMiddleware
from clef_runtime.server.context import RequestContext, start_context
from clef_runtime.server.errors import error_body
from clef_runtime.server.metrics import ServerMetrics
from clef_runtime.server.tracing import Tracing, begin_request

__all__ = ["RequestContextMiddleware"]

logger = logging.getLogger("clef_runtime.server")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# /status.json is polled by the status page every few seconds.
_QUIET_ROUTES = frozenset({"/health", "/ready", "/metrics", "/status.json"})


class RequestContextMiddleware(HttpMiddleware):
    """Pure ASGI middleware: a request id on every response, metrics, one log line per request, and a
    500 body naming the request id for any unhandled exception.

    ``send_request_id=False`` behind a proxy that puts the request's id on the response itself (Ray Serve's
    proxy, which also hands the id to this app in the request's x-request-id): a second header would repeat
    it. Metrics are labelled by route template: a known path (``route_paths``), or the template of the
    matched route (the Workers AI route has path parameters), never the raw path of an unknown URL.
    With ``tracing`` every request also gets a span (`clef_runtime.server.tracing`), named the same way."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: ServerMetrics,
        route_paths: frozenset[str],
        send_request_id: bool,
        tracing: Tracing | None = None,
    ) -> None:
        super().__init__(app)
        self.metrics = metrics
        self.route_paths = route_paths
        self.send_request_id = send_request_id
        self.tracing = tracing

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        incoming = _header(scope, b"x-request-id")
        request_id = incoming if incoming and _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        context = start_context(scope, request_id, started)
        # Probes and scrapes are not traced: one span each every few seconds would bury the requests.
        quiet = scope.get("path", "") in _QUIET_ROUTES
        trace = begin_request(None if quiet else self.tracing, scope, request_id)
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
                for name, value in context.rate_limit_headers.items():
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
            _log_request(scope, context, label, code, elapsed)
            if trace is not None:
                trace.finish(label, code)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _log_request(scope: Scope, context: RequestContext, route: str, status: int, elapsed: float) -> None:
    level = logging.DEBUG if route in _QUIET_ROUTES and status < 400 else logging.INFO
    if not logger.isEnabledFor(level):
        return
    parts = [
        f"request_id={context.request_id}",
        f"{scope.get('method')} {scope.get('path')}",
        f"status={status}",
        f"ms={elapsed * 1000:.1f}",
        *context.log_fields(),
    ]
    logger.log(level, " ".join(parts))
