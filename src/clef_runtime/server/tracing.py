"""OpenTelemetry traces: one span per request, with children for its body read, encode, queue wait, engine
steps and head, exported over OTLP (http/protobuf or gRPC) with the official SDK.

Tracing is on with ``--otlp-traces-endpoint`` or the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` variables (the SDK's exporters read those and ``OTEL_EXPORTER_OTLP_HEADERS``
themselves). Off, nothing here imports the SDK and no request builds a span: the middleware holds None and
`phase` is a no-op context.

The engine knows nothing of tracing: it reports when a request was submitted and when each of its steps ran
(`clef_runtime.engine.decision.RequestTimings`, on the loop's monotonic clock), and `record_decision` builds
the queue, step and head spans from that record after the fact, with explicit start and end times.

Under ``--ray`` the ingress sends the request span's W3C trace context (`trace_context`) with each request to
its model replica, and the replica, with a tracer of its own, builds a ``clef.replica`` span under it with the
engine spans as its children (`record_replica`): only the replica's process can place its loop's moments.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from starlette.requests import HTTPConnection
    from starlette.types import Scope

    from clef_runtime.engine.contract import PreparedItem
    from clef_runtime.engine.decision import Decision, RequestTimings

__all__ = [
    "PROTOCOLS",
    "RequestTrace",
    "Tracing",
    "begin_request",
    "check_endpoint",
    "exporters_installed",
    "missing_extra_message",
    "phase",
    "record_decision",
    "record_replica",
    "start_tracing",
    "trace_context",
]

logger = logging.getLogger("clef_runtime.server")

PROTOCOLS = ("http/protobuf", "grpc")
"""The OTLP transports the exporters speak (``--otlp-traces-protocol``)."""

_STANDARD_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_STANDARD_PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
_EXPORTER_MODULES = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}
_MISSING_EXTRA = "--otlp-traces-endpoint needs the OpenTelemetry exporters: pip install 'clef-runtime[otel]'"
# Where the request's trace lives in the ASGI scope's state (beside the request context).
_STATE_KEY = "clef_trace"
# The trace of the request being served on this task, for a call that leaves the process (`trace_context`):
# the dispatcher that sends it to a replica sees the request's task, not its scope.
_CURRENT: ContextVar[RequestTrace | None] = ContextVar("clef_trace", default=None)


def check_endpoint(url: str) -> str:
    """``url`` if it is an http(s) URL with a host; raises ``ValueError`` saying what is wrong otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r} (e.g. http://127.0.0.1:4318)")
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError(f"the port of {url!r} is not a number from 0 to 65535") from None
    return url.strip()


def exporters_installed(protocol: str) -> bool:
    """Whether the OTLP exporter of ``protocol`` is installed (the ``otel`` extra), without importing it."""
    try:
        return importlib.util.find_spec(_EXPORTER_MODULES[protocol]) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def missing_extra_message() -> str:
    """What ``clef serve`` says when tracing is asked for without the exporters."""
    return _MISSING_EXTRA


def _protocol(flag: str | None, environ: Mapping[str, str]) -> str:
    if flag is not None:
        return flag
    for name in _STANDARD_PROTOCOLS:
        if environ.get(name, "").strip() in PROTOCOLS:
            return environ[name].strip()
    return "http/protobuf"


def _traces_url(endpoint: str, protocol: str) -> str:
    """The exporter's endpoint for ``--otlp-traces-endpoint``: a collector's base URL gets OTLP/HTTP's
    ``/v1/traces`` path (as ``OTEL_EXPORTER_OTLP_ENDPOINT`` does); a URL with a path is taken as it is."""
    if protocol == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


@dataclass(frozen=True)
class Tracing:
    """The server's tracer and the provider that exports its spans (shut down with the app)."""

    tracer: Tracer
    provider: TracerProvider

    def shutdown(self) -> None:
        """Export what is still buffered, then stop the exporter."""
        self.provider.shutdown()


def start_tracing(
    endpoint: str | None, protocol_flag: str | None, environ: Mapping[str, str] | None = None
) -> Tracing | None:
    """The tracer of the server's ``--otlp-traces-endpoint`` and ``--otlp-traces-protocol`` (None: not
    given), or None when tracing is off (nothing of the SDK is imported then).

    On with ``endpoint`` or a standard OTLP endpoint variable in ``environ`` (default ``os.environ``),
    unless ``OTEL_SDK_DISABLED`` is true. Raises RuntimeError naming the ``otel`` extra when the flag asks
    for it without the exporters (the settings refuse that first); the variables alone only log a warning.
    """
    environ = os.environ if environ is None else environ
    standard = next((name for name in _STANDARD_ENDPOINTS if environ.get(name)), None)
    if endpoint is None and standard is None:
        return None
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    protocol = _protocol(protocol_flag, environ)
    if not exporters_installed(protocol):
        if endpoint is not None:
            raise RuntimeError(_MISSING_EXTRA)
        logger.warning("%s is set but the 'otel' extra is not installed: tracing is off", standard)
        return None
    return _sdk_tracing(None if endpoint is None else _traces_url(endpoint, protocol), protocol, environ)


def _sdk_tracing(url: str | None, protocol: str, environ: Mapping[str, str]) -> Tracing:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

    from clef_runtime.version import __version__

    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=url) if url else GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter(endpoint=url) if url else HttpExporter()
    service = environ.get("OTEL_SERVICE_NAME") or "clef-runtime"
    resource = Resource.create({"service.name": service, "service.version": __version__})
    # A provider of its own, not the global one: an embedding application keeps its own tracing.
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    logger.info("tracing: OTLP %s to %s", protocol, url or "the OTEL_EXPORTER_OTLP_* endpoint")
    return Tracing(provider.get_tracer("clef_runtime.server", __version__), provider)


class RequestTrace:
    """One request's span (the server span) and what its children need: the tracer and the span's context."""

    def __init__(self, tracing: Tracing, scope: Scope, request_id: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        headers = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope.get("headers", ())
            if key in (b"traceparent", b"tracestate")
        }
        # An incoming W3C traceparent makes this span its child; a malformed one is ignored (a new trace).
        parent = TraceContextTextMapPropagator().extract(headers)
        method = scope.get("method", "")
        self.method = method
        self.tracer = tracing.tracer
        self.span: Span = self.tracer.start_span(
            f"{method} {scope.get('path', '')}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": scope.get("path", ""),
                "clef.request_id": request_id,
            },
        )
        self.context = trace.set_span_in_context(self.span)
        self._current = _CURRENT.set(self)

    def child(
        self, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None
    ) -> None:
        """A finished child span from ``start_ns`` to ``end_ns`` (nanoseconds since the epoch)."""
        _finished_span(self.tracer, self.context, name, start_ns, end_ns, attributes)

    def finish(self, route: str, status: int) -> None:
        """End the request's span, named by its route template, with its status."""
        from opentelemetry.trace import Status, StatusCode

        self.span.update_name(f"{self.method} {route}")
        self.span.set_attribute("http.route", route)
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()
        _CURRENT.reset(self._current)


def _finished_span(
    tracer: Tracer,
    parent: Context,
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    span = tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    span.end(end_time=end_ns)


def begin_request(tracing: Tracing | None, scope: Scope, request_id: str) -> RequestTrace | None:
    """The request's trace (kept in its scope for `phase` and `record_decision`), None with tracing off."""
    if tracing is None:
        return None
    trace = RequestTrace(tracing, scope, request_id)
    scope.setdefault("state", {})[_STATE_KEY] = trace
    return trace


def _trace_of(request: HTTPConnection) -> RequestTrace | None:
    trace = request.scope.get("state", {}).get(_STATE_KEY)
    return trace if isinstance(trace, RequestTrace) else None


@contextlib.contextmanager
def phase(request: HTTPConnection, name: str) -> Iterator[None]:
    """A child span of the request's around the block (``clef.read_body``, ``clef.encode``); nothing
    when the request is not traced."""
    trace = _trace_of(request)
    if trace is None:
        yield
        return
    start = time.time_ns()
    try:
        yield
    finally:
        trace.child(name, start, time.time_ns())


def record_decision(request: HTTPConnection, prepared: PreparedItem, decision: Decision) -> None:
    """Put the decision on the request's span (GenAI attributes where they fit, ``clef.*`` for the rest)
    and add its engine spans: ``clef.queue`` (submission to first step), one ``clef.step`` per step it took
    part in, and ``clef.head`` (the head's scoring at the end of its last step). Nothing when the request
    is not traced."""
    trace = _trace_of(request)
    if trace is None:
        return
    record = prepared.record
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "decide",
        "gen_ai.request.model": prepared.request.model or decision.model,
        "gen_ai.response.model": decision.model,
        "gen_ai.usage.input_tokens": record.input_tokens,
        "clef.cached_tokens": decision.cache.cached_tokens,
        "clef.state_cache": decision.cache.status,
        "clef.questions": len(prepared.request.questions),
        "clef.steps": decision.timings.steps,
    }
    if decision.head is not None:
        attributes["clef.head.name"] = decision.head.name
        attributes["clef.head.digest"] = decision.head.digest
    if decision.replica is not None:
        attributes["clef.replica"] = decision.replica
    trace.span.set_attributes(attributes)
    if decision.replica is None:
        # A scale-out replica's moments are on its own process's clock (maybe another machine's): the
        # replica builds its engine spans itself (`record_replica`).
        _engine_spans(trace.tracer, trace.context, decision.timings)


def _engine_spans(tracer: Tracer, parent: Context, timings: RequestTimings) -> None:
    """The engine spans of one decision under ``parent``: ``clef.queue``, ``clef.step`` (numbered) and
    ``clef.head``, from ``timings`` taken on this process's monotonic clock (nothing for an engine without a
    loop, which reports no moments)."""
    if timings.submitted_at is None or not timings.step_times:
        return
    # The loop's clock is time.monotonic: moments become epoch nanoseconds by their distance from now.
    now_ns, now = time.time_ns(), time.monotonic()

    def epoch_ns(moment: float) -> int:
        return now_ns - round((now - moment) * 1e9)

    first_start = timings.step_times[0][0]
    _finished_span(tracer, parent, "clef.queue", epoch_ns(timings.submitted_at), epoch_ns(first_start))
    for number, (start, end) in enumerate(timings.step_times, 1):
        attributes = {"clef.step.number": number}
        _finished_span(tracer, parent, "clef.step", epoch_ns(start), epoch_ns(end), attributes)
    last_end = epoch_ns(timings.step_times[-1][1])
    _finished_span(tracer, parent, "clef.head", last_end - round(timings.head_s * 1e9), last_end)


def trace_context() -> dict[str, str] | None:
    """The W3C trace context (``traceparent``) of the request being served on this task, for a process
    that works on it (a scale-out replica); None when the request is not traced."""
    trace = _CURRENT.get()
    if trace is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.context)
    return carrier


def record_replica(
    tracing: Tracing,
    carrier: Mapping[str, str],
    replica: str,
    start_ns: int,
    end_ns: int,
    timings: RequestTimings,
) -> None:
    """A scale-out replica's span for one request: ``clef.replica`` (attribute ``clef.replica``: its id) from
    ``start_ns`` to ``end_ns``, the child of the span that sent it (``carrier``: `trace_context`'s), with the
    decision's engine spans under it. Called in the replica's process: ``timings`` are on its clock."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract(carrier)
    span = tracing.tracer.start_span(
        "clef.replica",
        context=parent,
        kind=trace.SpanKind.SERVER,
        start_time=start_ns,
        attributes={"clef.replica": replica},
    )
    _engine_spans(tracing.tracer, trace.set_span_in_context(span), timings)
    span.end(end_time=end_ns)
