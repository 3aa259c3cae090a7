"""OpenTelemetry traces, received by real OTLP receivers started here on 127.0.0.1 (OTLP/HTTP: a small HTTP
server; OTLP/gRPC: a gRPC server of the collector's trace service) and decoded with the OTLP protobufs: the
request span joins the caller's trace, its children are the body read, encode, queue, steps and head, and
the attributes name the model, tokens, request id and head."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from devtools.harness import start_clef_server
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from clef_runtime.server.settings import ServerSettings, SettingsError, server_settings
from tests.server.conftest import build_app
from tests.server.helpers import REQUEST

REPO = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
CHILDREN = {"clef.read_body", "clef.encode", "clef.queue", "clef.step", "clef.head"}


class Received:
    """The spans an OTLP receiver decoded, with the resource attributes they came with."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                self.resources.append(_attributes(resource_spans.resource.attributes))
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)


def _attributes(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        value = pair.value
        out[pair.key] = getattr(value, value.WhichOneof("value"))
    return out


@contextmanager
def otlp_http_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver: POST /v1/traces with a protobuf body; yields its base URL."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.add(request)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def http_receiver() -> Iterator[tuple[str, Received]]:
    with otlp_http_receiver() as receiver:
        yield receiver


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver (the collector's TraceService); yields its URL."""
    received = Received()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(
            self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
        ) -> trace_service_pb2.ExportTraceServiceResponse:
            received.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"http://127.0.0.1:{port}", received
    server.stop(None)


def _by_trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [span for span in spans if span.trace_id.hex() == trace_id]


def _request_span(spans: list[Span]) -> Span:
    (root,) = [span for span in spans if span.kind == Span.SPAN_KIND_SERVER]
    return root


def _check_request_trace(spans: list[Span], trace_id: str, parent_id: str | None) -> dict[str, Any]:
    """The request span and its children: parent links, times inside the request's, names; returns the
    request span's attributes."""
    root = _request_span(spans)
    assert root.name == "POST /v1/systemone"
    if parent_id is not None:
        assert root.parent_span_id.hex() == parent_id
    children = [span for span in spans if span is not root]
    assert {span.name for span in children} == CHILDREN
    for child in children:
        assert child.trace_id.hex() == trace_id
        assert child.parent_span_id == root.span_id
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= root.end_time_unix_nano
    order = {span.name: span for span in children}
    # The phases follow each other: read, encode, wait in the queue, compute (steps, the head at their end).
    assert order["clef.read_body"].end_time_unix_nano <= order["clef.encode"].start_time_unix_nano
    assert order["clef.encode"].end_time_unix_nano <= order["clef.queue"].start_time_unix_nano + 1_000_000
    steps = sorted((s for s in children if s.name == "clef.step"), key=lambda s: s.start_time_unix_nano)
    assert order["clef.queue"].end_time_unix_nano <= steps[0].start_time_unix_nano
    assert steps[-1].start_time_unix_nano <= order["clef.head"].start_time_unix_nano
    return _attributes(root.attributes)


@pytest.mark.slow
def test_a_served_request_is_traced_over_otlp_http_joining_the_callers_trace(
    http_receiver: tuple[str, Received],
) -> None:
    url, received = http_receiver
    server = start_clef_server("tiny", log_level="warning", jobs=False, otlp_traces_endpoint=url)
    try:
        joined = httpx.post(
            f"{server.url}/v1/systemone",
            json=REQUEST,
            headers={"traceparent": TRACEPARENT, "x-request-id": "traced-1"},
            timeout=60,
        )
        assert joined.status_code == 200, joined.text
        fresh = httpx.post(
            f"{server.url}/v1/systemone",
            json=REQUEST,
            headers={"traceparent": "00-not-a-trace-01", "x-request-id": "traced-2"},
            timeout=60,
        )
        assert fresh.status_code == 200, fresh.text
    finally:
        assert server.stop() == 0  # SIGTERM: the lifespan's end exports what is buffered
    body = joined.json()
    attributes = _check_request_trace(_by_trace(received.spans, TRACE_ID), TRACE_ID, PARENT_ID)
    assert attributes["clef.request_id"] == "traced-1"
    assert attributes["gen_ai.request.model"] == "jev-latest"
    assert attributes["gen_ai.usage.input_tokens"] == body["usage"]["input_tokens"]
    assert attributes["clef.questions"] == 3
    assert attributes["clef.head.digest"] == body["x_head"]["digest"]
    assert attributes["clef.head.name"] == body["x_head"]["name"]
    assert attributes["http.response.status_code"] == 200
    assert attributes["http.route"] == "/v1/systemone"
    assert {"service.name": "clef-runtime"}.items() <= received.resources[0].items()
    # The harness polled /ready until the model was loaded: probes are not traced.
    assert all(span.kind != Span.SPAN_KIND_SERVER or "systemone" in span.name for span in received.spans)
    # A malformed traceparent is ignored: the second request starts a trace of its own, without a parent.
    others = [span for span in received.spans if span.trace_id.hex() != TRACE_ID]
    (other_root,) = [s for s in others if s.kind == Span.SPAN_KIND_SERVER]
    assert _attributes(other_root.attributes)["clef.request_id"] == "traced-2"
    assert other_root.parent_span_id == b""
    _check_request_trace(_by_trace(others, other_root.trace_id.hex()), other_root.trace_id.hex(), None)


def test_the_standard_variables_turn_tracing_on_over_grpc(
    grpc_receiver: tuple[str, Received], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No flag: ``OTEL_EXPORTER_OTLP_ENDPOINT`` and ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` (read by the SDK's
    exporter itself) and ``OTEL_SERVICE_NAME``."""
    from devtools.fake_engine import FakeClef

    url, received = grpc_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "clef-under-test")
    settings = ServerSettings(
        model="fake", jobs_db=str(tmp_path / "jobs.db"), classifiers_db=str(tmp_path / "c.db")
    )
    app = build_app(settings, FakeClef(max_length=settings.input_token_limit))
    with TestClient(app) as client:
        assert app.state.runtime.wait_until_loaded(10)
        response = client.post("/v1/systemone", json=REQUEST, headers={"traceparent": TRACEPARENT})
        assert response.status_code == 200, response.text
    # Leaving the client ended the lifespan, which flushed the exporter.
    spans = _by_trace(received.spans, TRACE_ID)
    root = _request_span(spans)
    assert root.parent_span_id.hex() == PARENT_ID
    assert {span.name for span in spans if span is not root} >= {
        "clef.read_body",
        "clef.encode",
        "clef.queue",
    }
    assert received.resources[0]["service.name"] == "clef-under-test"


def test_tracing_off_imports_no_sdk(tmp_path: Path) -> None:
    """Zero cost when off: an app built without the flag or the variables never imports the SDK; with the
    flag, it does (the check can fail)."""
    script = (
        "import sys\n"
        "from clef_runtime.server.app import create_app\n"
        "from clef_runtime.server.settings import server_settings\n"
        "create_app(server_settings('tiny', jobs=False, otlp_traces_endpoint=sys.argv[1] or None))\n"
        "print('opentelemetry.sdk.trace' in sys.modules)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"), "HOME": str(tmp_path)}
    off = subprocess.run([sys.executable, "-c", script, ""], capture_output=True, text=True, env=env)
    on = subprocess.run(
        [sys.executable, "-c", script, "http://127.0.0.1:9"], capture_output=True, text=True, env=env
    )
    assert (off.stdout.strip(), on.stdout.strip()) == ("False", "True"), off.stderr + on.stderr


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"otlp_traces_endpoint": "localhost:4318"}, "--otlp-traces-endpoint: not an http(s) URL"),
        ({"otlp_traces_endpoint": "http://:4318"}, "--otlp-traces-endpoint: not an http(s) URL"),
        ({"otlp_traces_endpoint": "http://h:99999"}, "--otlp-traces-endpoint: the port"),
        ({"otlp_traces_protocol": "thrift"}, "--otlp-traces-protocol must be http/protobuf or grpc"),
    ],
)
def test_a_bad_endpoint_or_protocol_is_refused_naming_the_flag(values: dict[str, str], expected: str) -> None:
    with pytest.raises(SettingsError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        server_settings("tiny", **values)


def test_the_flag_without_the_otel_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "opentelemetry.exporter.otlp.proto.http",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SettingsError, match=r"pip install 'clef-runtime\[otel\]'"):
        server_settings("tiny", otlp_traces_endpoint="http://127.0.0.1:4318")


def test_clef_serve_exits_2_on_a_bad_endpoint(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clef_runtime.cli", "serve", "--model", "tiny", "--otlp-traces-endpoint", "x"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"), "HOME": str(tmp_path)},
    )
    assert result.returncode == 2
    assert "--otlp-traces-endpoint" in result.stderr and "not an http(s) URL" in result.stderr
