"""The application's assembly: one list of features, each attached once, what they open closed whatever
happens, and the per-request context that carries a request's fields to its log line."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, ExitStack, asynccontextmanager
from pathlib import Path

import pytest
from devtools.fake_engine import FakeClef
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from starlette.requests import Request

from clef_runtime.server.app import FEATURES, create_app
from clef_runtime.server.context import RequestContext, context_of
from clef_runtime.server.feature import Feature
from clef_runtime.server.settings import ServerSettings


def _settings(tmp_path: Path) -> ServerSettings:
    return ServerSettings(
        model="fake",
        jobs_db=str(tmp_path / "jobs.sqlite3"),
        classifiers_db=str(tmp_path / "classifiers.sqlite3"),
    )


def test_every_feature_is_listed_once_and_serves_its_routes(tmp_path: Path) -> None:
    names = [feature.name for feature in FEATURES]
    assert len(names) == len(set(names))
    app = create_app(_settings(tmp_path), engine_factory=lambda s: FakeClef())
    with TestClient(app) as client:
        assert app.state.runtime.wait_until_loaded(10)
        paths = set(client.get("/openapi.json").json()["paths"])
        for route in (r for feature in FEATURES for r in feature.router.routes):
            path = getattr(route, "path_format", None)  # without a {name:convertor} suffix
            if getattr(route, "include_in_schema", False) and path is not None:
                assert path in paths, path
        # MCP's route is attached by its hook, outside the schema.
        assert client.post("/mcp", json=[]).status_code != 404


class _Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def feature(self, name: str, *, fail: bool = False) -> Feature:
        def attach(app: FastAPI, resources: ExitStack) -> AbstractAsyncContextManager[None]:
            if fail:
                raise RuntimeError(f"{name} cannot open its database")
            self.events.append(f"open {name}")
            resources.callback(self.events.append, f"close {name}")
            return self._running(name)

        return Feature(name, APIRouter(), attach=attach)

    @asynccontextmanager
    async def _running(self, name: str) -> AsyncIterator[None]:
        self.events.append(f"start {name}")
        try:
            yield
        finally:
            self.events.append(f"stop {name}")


def test_features_start_in_order_stop_in_reverse_and_close_after_the_server(tmp_path: Path) -> None:
    recorder = _Recorder()
    features = (recorder.feature("a"), recorder.feature("b"))
    app = create_app(_settings(tmp_path), engine_factory=lambda s: FakeClef(), features=features)
    assert recorder.events == ["open a", "open b"]  # opened before the server listens
    with TestClient(app):
        assert recorder.events[2:] == ["start a", "start b"]
    assert recorder.events[4:] == ["stop b", "stop a", "close b", "close a"]


def test_a_feature_that_fails_to_open_closes_what_the_others_opened(tmp_path: Path) -> None:
    recorder = _Recorder()
    features = (recorder.feature("a"), recorder.feature("b", fail=True), recorder.feature("c"))
    with pytest.raises(RuntimeError, match="b cannot open"):
        create_app(_settings(tmp_path), engine_factory=lambda s: FakeClef(), features=features)
    assert recorder.events == ["open a", "close a"]


def test_the_log_fields_are_the_ones_set_in_field_order() -> None:
    context = RequestContext("id-1", 0.0, rate_limit_headers={"X-RateLimit-Limit": "1"})
    assert context.log_fields() == []
    context.steps = 2
    context.key = "alice"
    context.caller = "alice"  # the rate limiter's label is not a field of the line
    assert context.log_fields() == ["key=alice", "steps=2"]


def test_a_request_outside_the_middleware_gets_a_context_of_its_own() -> None:
    request = Request({"type": "http", "headers": [], "method": "GET", "path": "/"})
    first = context_of(request)
    first.head = "tiny@0123456789ab"
    assert context_of(request) is first and len(first.request_id) == 32
    assert context_of(Request({"type": "http", "headers": []})) is not first
