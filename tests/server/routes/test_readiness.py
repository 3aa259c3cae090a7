"""Readiness and loading: /health answers at once, the rest is 503 until warm, a failed load is fatal."""

from __future__ import annotations

import threading

from devtools.fake_engine import FakeClef
from fastapi.testclient import TestClient

from clef_runtime.server.app import create_app
from clef_runtime.server.settings import ServerSettings
from tests.server.helpers import REQUEST, assert_error_shape, post


class LoadingEngine(FakeClef):
    """Warm-up waits for ``loaded`` so tests can look at the server while it is loading."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = threading.Event()

    def warmup(self, *, max_rows: int = 32) -> None:
        assert self.loaded.wait(10)


def test_health_answers_at_once_and_everything_else_is_503_until_warm() -> None:
    engine = LoadingEngine()
    app = create_app(ServerSettings(model="fake"), engine_factory=lambda s: engine)
    with TestClient(app) as client:
        health = client.get("/health").json()
        assert (health["state"], health["ready"]) == ("loading", False)
        for response in (client.get("/ready"), post(client, REQUEST), client.get("/v1/models")):
            assert_error_shape(response, 503, "not_ready")
            assert int(response.headers["retry-after"]) >= 1
        engine.loaded.set()
        assert app.state.runtime.wait_until_loaded(10)
        assert client.get("/ready").status_code == 200
        assert post(client, REQUEST).status_code == 200


def test_a_failed_load_is_reported_and_fatal() -> None:
    fatal: list[BaseException] = []

    def broken(settings: ServerSettings) -> FakeClef:
        raise FileNotFoundError("no such checkpoint: /nowhere")

    app = create_app(ServerSettings(model="/nowhere"), engine_factory=broken, on_fatal=fatal.append)
    with TestClient(app) as client:
        app.state.runtime.wait_until_loaded(10)
        assert client.get("/health").json()["state"] == "failed"
        detail = assert_error_shape(client.get("/ready"), 503, "not_ready")
        assert "no such checkpoint" in detail["message"]
    assert isinstance(fatal[0], FileNotFoundError)
