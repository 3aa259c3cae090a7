"""Fixtures for the fast API tests: an app around the fake engine, in-process (TestClient) or on a real
loopback socket (uvicorn in a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from devtools.fake_engine import FakeClef, GatedEngine
from fastapi import FastAPI
from fastapi.testclient import TestClient

from clef_runtime.server.app import create_app
from clef_runtime.server.settings import ServerSettings
from tests.serving import free_port


@dataclass
class Served:
    client: TestClient
    app: FastAPI
    engine: FakeClef
    settings: ServerSettings


def build_app(settings: ServerSettings, engine: FakeClef) -> FastAPI:
    return create_app(settings, engine_factory=lambda s: engine)


def _own_jobs_db(factory: pytest.TempPathFactory, overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` with jobs and classifiers databases of this app's own unless given: a jobs database
    belongs to one server at a time, a test may run several servers at once, and a test's classifiers must
    not meet another's (the default classifiers database is shared by every server)."""
    data = factory.mktemp("data")
    own = {"jobs_db": str(data / "jobs.sqlite3"), "classifiers_db": str(data / "classifiers.sqlite3")}
    return {**own, **overrides}


@pytest.fixture
def serve_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Served]]:
    """``serve_fake(engine=None, **settings)`` -> a started app with a ready fake engine."""
    with ExitStack() as stack:

        def start(engine: FakeClef | None = None, **overrides: Any) -> Served:
            settings = ServerSettings(**{"model": "fake", **_own_jobs_db(tmp_path_factory, overrides)})
            engine = engine or FakeClef(max_length=settings.input_token_limit)
            app = build_app(settings, engine)
            client = stack.enter_context(TestClient(app, raise_server_exceptions=False))
            assert app.state.runtime.wait_until_loaded(10)
            return Served(client, app, engine, settings)

        yield start


@pytest.fixture
def client(serve_fake: Callable[..., Served]) -> TestClient:
    """A client of a default app (auth off, default limits) with a fake engine."""
    return serve_fake().client


@dataclass
class LiveServer:
    url: str
    port: int
    app: FastAPI
    engine: FakeClef
    server: uvicorn.Server


@pytest.fixture
def live_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LiveServer]]:
    """``live_fake(engine, **settings)`` -> uvicorn serving the fake engine on a free loopback port, in a
    thread (signals are not installed off the main thread)."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(engine: FakeClef, **overrides: Any) -> LiveServer:
        port = free_port()
        values = {"model": "fake", "port": port, **_own_jobs_db(tmp_path_factory, overrides)}
        settings = ServerSettings(**values)
        app = build_app(settings, engine)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on"
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not (server.started and app.state.runtime.state == "ready"):
            assert time.monotonic() < deadline, "live server did not start"
            time.sleep(0.01)
        return LiveServer(f"http://127.0.0.1:{port}", port, app, engine, server)

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def send_behind_a_held_call(
    served: Served, engine: GatedEngine, bodies: Sequence[Any], holder: Any
) -> tuple[Any, list[Any]]:
    """Send ``holder`` and hold the engine on it, send ``bodies`` and wait until every one is queued behind
    it, then release the engine. Returns (holder's response, the responses to ``bodies`` in order)."""
    runtime = served.app.state.runtime
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        first = pool.submit(served.client.post, "/v1/systemone", json=holder)
        assert engine.first_entered.wait(10)
        futures = [pool.submit(served.client.post, "/v1/systemone", json=body) for body in bodies]
        deadline = time.monotonic() + 30  # a bound on waiting, not a timing assumption
        while runtime.queue_depth() < len(bodies):
            assert time.monotonic() < deadline, "requests did not queue"
            time.sleep(0.002)
        engine.gate.set()
        return first.result(30), [future.result(30) for future in futures]
