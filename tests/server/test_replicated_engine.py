"""The info routes of an engine with model replicas (what ``clef serve --ray``'s ingress engine reports),
through the contract alone: ``/ready`` and ``/status.json`` show the replicas, ``/metrics`` exports each
replica's state cache under a ``replica`` label, and every call reaches the engine off the event loop (the
ingress's calls block on the cluster; Ray Serve refuses them on a running loop). The real thing, on a local
Ray cluster: ``tests/scale/test_ray_serve.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from clef_runtime.engine.contract import ReplicaReport, ReplicaStatus
from tests.server.conftest import Served
from tests.server.fake_engine import FakeClef


def _refuse_a_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise AssertionError("a blocking engine call ran on the event loop")


class ReplicatedEngine(FakeClef):
    """Two replicas with state caches; ``up`` of them running."""

    def __init__(self, up: int = 2) -> None:
        super().__init__()
        self.up = up
        self.reports = (
            ReplicaReport("r1", 101, {"hits": 3, "misses": 1, "entries": 1}),
            ReplicaReport("r2", 102, {"hits": 1, "misses": 1, "entries": 1}),
        )

    def replica_status(self) -> ReplicaStatus:
        _refuse_a_running_loop()
        return ReplicaStatus(up=self.up, target=2, reports=self.reports[: self.up])

    def cache_stats(self) -> dict[str, int]:
        _refuse_a_running_loop()
        return {"hits": 4, "misses": 2, "entries": 2}


def test_ready_reports_the_replicas(serve_fake: Callable[..., Served]) -> None:
    response = serve_fake(ReplicatedEngine()).client.get("/ready")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "model": "fake-clef", "replicas": {"up": 2, "target": 2}}


def test_ready_is_503_without_a_running_replica(serve_fake: Callable[..., Served]) -> None:
    response = serve_fake(ReplicatedEngine(up=0)).client.get("/ready")
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert "no model replica is running" in response.text


def test_status_json_shows_each_replica_and_their_sum(serve_fake: Callable[..., Served]) -> None:
    status = serve_fake(ReplicatedEngine()).client.get("/status.json").json()
    assert (status["device"], status["weights"]) == ("cpu", "fp32")
    assert status["state_cache"] == {"hits": 4, "misses": 2, "entries": 2, "hit_rate": 0.6667}
    assert status["replicas"] == {
        "up": 2,
        "target": 2,
        "reports": [
            {
                "replica": "r1",
                "pid": 101,
                "state_cache": {"hits": 3, "misses": 1, "entries": 1, "hit_rate": 0.75},
            },
            {
                "replica": "r2",
                "pid": 102,
                "state_cache": {"hits": 1, "misses": 1, "entries": 1, "hit_rate": 0.5},
            },
        ],
    }


def test_status_json_has_no_replicas_for_an_engine_in_this_process(serve_fake: Callable[..., Served]) -> None:
    assert serve_fake().client.get("/status.json").json()["replicas"] is None


def test_metrics_export_each_replicas_cache_under_its_label(serve_fake: Callable[..., Served]) -> None:
    text = serve_fake(ReplicatedEngine()).client.get("/metrics").text
    assert 'clef_cache_hits_total{replica="r1"} 3.0' in text
    assert 'clef_cache_hits_total{replica="r2"} 1.0' in text
    assert 'clef_cache_entries{replica="r2"} 1.0' in text and "# TYPE clef_cache_entries gauge" in text
    assert "clef_cache_hits_total 4.0" not in text  # no unlabelled sum beside the replicas' series
