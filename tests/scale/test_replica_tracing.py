"""Tracing across the ingress and a model replica, without a Ray cluster: the ingress app with the real
`ReplicaDispatcher`, whose fake deployment handle calls the real `ClefModel.decide` of a replica with its own
engine loop on the tiny model and its own tracer (as its own process would have), both exporting to one
OTLP/HTTP receiver. The replica's span joins the ingress's request span through the W3C context the
dispatcher passes on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from clef_runtime.engine.clef import Clef
from clef_runtime.engine.loop import EngineLoop
from clef_runtime.scale.ray_serve import ClefModel, ReplicaDispatcher, ReplicaReports, build_application
from clef_runtime.scale.settings import RaySettings
from clef_runtime.server.app import create_app
from clef_runtime.server.runtime import step_settings
from clef_runtime.server.settings import ServerSettings
from clef_runtime.server.tracing import start_tracing
from tests.server.helpers import REQUEST
from tests.server.test_tracing import (
    PARENT_ID,
    TRACE_ID,
    TRACEPARENT,
    Received,
    _attributes,
    otlp_http_receiver,
)

ENGINE_SPANS = {"clef.queue", "clef.step", "clef.head"}


class Outcome:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


@pytest.fixture
def http_receiver() -> Iterator[tuple[str, Received]]:
    with otlp_http_receiver() as receiver:
        yield receiver


@pytest.fixture
def replica(http_receiver: tuple[str, Received], tiny: Clef) -> Iterator[ClefModel]:
    """A model replica (the real class, built by hand: no Ray) on the tiny model, tracing to the receiver."""
    url, _ = http_receiver
    settings = ServerSettings(model="tiny", otlp_traces_endpoint=url)
    model = object.__new__(ClefModel)
    model.engine = tiny
    model.replica_id = "replica-1"
    model.loop = EngineLoop(model.engine.runner(), step_settings(model.engine, settings), max_queue=8)
    model.loop.start()
    model.tracing = start_tracing(settings.otlp_traces_endpoint, None)
    yield model
    model.__del__()  # closes the loop, exports what the replica's tracer buffered


def test_the_replicas_span_is_a_child_of_the_ingress_request_span(
    http_receiver: tuple[str, Received], replica: ClefModel, tiny: Clef, tmp_path: Path
) -> None:
    url, received = http_receiver
    sent: list[dict[str, str] | None] = []

    def remote(prepared: Any, **options: Any) -> Outcome:
        sent.append(options["trace_context"])
        return Outcome(asyncio.run(replica.decide(prepared, **options)))

    handle = SimpleNamespace(decide=SimpleNamespace(remote=remote))
    settings = ServerSettings(
        model="tiny",
        otlp_traces_endpoint=url,
        jobs_db=str(tmp_path / "jobs.db"),
        classifiers_db=str(tmp_path / "c.db"),
    )
    app = create_app(
        settings,
        engine_factory=lambda s: tiny,
        dispatcher_factory=lambda engine, s, runtime: ReplicaDispatcher(handle, s, ReplicaReports()),
    )
    with TestClient(app) as client:
        assert app.state.runtime.wait_until_loaded(10)
        response = client.post("/v1/systemone", json=REQUEST, headers={"traceparent": TRACEPARENT})
        assert response.status_code == 200, response.text
    replica.__del__()
    (carrier,) = sent
    assert carrier is not None and carrier["traceparent"].startswith(f"00-{TRACE_ID}-")

    spans = [span for span in received.spans if span.trace_id.hex() == TRACE_ID]
    (ingress,) = [span for span in spans if span.name == "POST /v1/systemone"]
    assert ingress.parent_span_id.hex() == PARENT_ID
    # The context carried the ingress's request span itself: the replica's span is its child.
    assert carrier["traceparent"] == f"00-{TRACE_ID}-{ingress.span_id.hex()}-01"
    (on_replica,) = [span for span in spans if span.name == "clef.replica"]
    assert on_replica.parent_span_id == ingress.span_id
    assert _attributes(on_replica.attributes)["clef.replica"] == "replica-1"
    assert _attributes(ingress.attributes)["clef.replica"] == "replica-1"
    # The engine's spans are the replica's children, inside it, in order; none hangs off the ingress's span.
    engine = [span for span in spans if span.parent_span_id == on_replica.span_id]
    assert {span.name for span in engine} == ENGINE_SPANS
    assert {s.name for s in spans if s.parent_span_id == ingress.span_id} == {
        "clef.read_body",
        "clef.encode",
        "clef.replica",
    }
    check_engine_spans(on_replica, engine)
    assert ingress.start_time_unix_nano <= on_replica.start_time_unix_nano
    assert on_replica.end_time_unix_nano <= ingress.end_time_unix_nano


def check_engine_spans(parent: Span, children: list[Span]) -> None:
    """Every child inside its parent, the queue before the steps, the head at the end of the last step."""
    for child in children:
        assert parent.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= parent.end_time_unix_nano
    (queue,) = [span for span in children if span.name == "clef.queue"]
    (head,) = [span for span in children if span.name == "clef.head"]
    steps = sorted((s for s in children if s.name == "clef.step"), key=lambda s: s.start_time_unix_nano)
    assert queue.end_time_unix_nano <= steps[0].start_time_unix_nano
    assert steps[-1].start_time_unix_nano <= head.start_time_unix_nano
    assert head.end_time_unix_nano == steps[-1].end_time_unix_nano


def test_a_request_without_a_trace_context_gets_no_replica_span(
    http_receiver: tuple[str, Received], replica: ClefModel, tiny: Clef
) -> None:
    """A batch-job line (no request span at the ingress) is not traced on the replica either."""
    _, received = http_receiver
    prepared = tiny.prepare(REQUEST)
    answer = asyncio.run(replica.decide(prepared))
    replica.__del__()
    assert answer.outcome().replica == "replica-1"
    assert [span.name for span in received.spans] == []


def test_the_standard_otel_variables_reach_every_deployments_actors() -> None:
    """A Ray worker does not inherit the deploying process's environment: the OTEL_* variables go in each
    deployment's runtime_env, nothing else does, and none when there is none."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SERVICE_NAME": "s", "HOME": "/h"}
    traced = build_application(ServerSettings(model="tiny"), RaySettings(ray=True), environ)
    plain = build_application(ServerSettings(model="tiny"), RaySettings(ray=True), {"HOME": "/h"})
    for application, expected in ((traced, {k: v for k, v in environ.items() if k != "HOME"}), (plain, None)):
        ingress = application._bound_deployment
        model = ingress.init_args[0]._bound_deployment
        for deployment in (ingress, model):
            runtime_env = deployment.ray_actor_options.get("runtime_env")
            assert (runtime_env or {}).get("env_vars") == expected, (deployment.name, runtime_env)
