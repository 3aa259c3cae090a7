"""The info routes of an engine with model replicas (what ``clef serve --ray``'s ingress engine reports),
through the contract alone: ``/ready`` and ``/status.json`` show the replicas, ``/metrics`` exports each
replica's state cache under a ``replica`` label, and every call reaches the engine off the event loop (the
ingress's calls block on the cluster; Ray Serve refuses them on a running loop), on threads of their own and
within a time limit: a cluster that fails or hangs makes ``/ready`` 503 and its figures unknown. The real
thing, on a local Ray cluster: ``tests/scale/test_ray_serve.py``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest
from devtools.fake_engine import FakeClef

from clef_runtime.engine.contract import ReplicaReport, ReplicaStatus
from clef_runtime.server.engine_queries import QUERY_THREADS
from tests.server.conftest import Served


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
    body = response.json()
    assert body["fused_kernels"]["reason"] == "cpu"  # the fake engine's card: cpu
    assert body == {
        "status": "ready",
        "model": "fake-clef",
        "fused_kernels": body["fused_kernels"],
        "replicas": {"up": 2, "target": 2},
    }


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


class UndeployedEngine(ReplicatedEngine):
    """Serve's controller has no such application (not deployed yet, or being replaced): ``serve.status()``
    has no entry for it. The replicas' cache counters still come."""

    def replica_status(self) -> ReplicaStatus:
        _refuse_a_running_loop()
        raise KeyError("clef")


class BrokenEngine(UndeployedEngine):
    """Neither the controller nor the replicas answer."""

    def cache_stats(self) -> dict[str, int]:
        raise ConnectionError("the cluster is gone")


class StuckEngine(ReplicatedEngine):
    """Serve's controller hangs: every figure waits until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def replica_status(self) -> ReplicaStatus:
        self.release.wait()
        return super().replica_status()


def test_ready_is_503_while_the_application_is_not_deployed(serve_fake: Callable[..., Served]) -> None:
    response = serve_fake(UndeployedEngine()).client.get("/ready")
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["detail"] == {
        "error_type": "not_ready",
        "message": "the model replicas cannot be counted: KeyError: 'clef'",
    }


def test_status_json_shows_unknown_replicas_and_the_figures_it_can_read(
    serve_fake: Callable[..., Served],
) -> None:
    status = serve_fake(UndeployedEngine()).client.get("/status.json")
    assert status.status_code == 200
    assert status.json()["replicas"] is None
    assert status.json()["state_cache"] == {"hits": 4, "misses": 2, "entries": 2, "hit_rate": 0.6667}
    broken = serve_fake(BrokenEngine()).client.get("/status.json")
    assert broken.status_code == 200
    assert (broken.json()["replicas"], broken.json()["state_cache"]) == (None, None)


def test_metrics_without_replica_figures_still_export_the_rest(serve_fake: Callable[..., Served]) -> None:
    response = serve_fake(UndeployedEngine()).client.get("/metrics")
    assert response.status_code == 200
    assert "clef_model_ready 1.0" in response.text and "clef_cache_" not in response.text


@pytest.fixture
def stuck(serve_fake: Callable[..., Served]) -> Iterator[tuple[Served, StuckEngine]]:
    """A served engine whose cluster hangs (released at teardown), with a short query time limit."""
    engine = StuckEngine()
    served = serve_fake(engine)
    served.app.state.runtime.engine_queries.timeout_s = 0.05
    try:
        yield served, engine
    finally:
        engine.release.set()
        for thread in threading.enumerate():
            if thread.name == "clef-engine-query":
                thread.join()


def test_a_hanging_cluster_makes_ready_503_and_the_figures_unknown(
    stuck: tuple[Served, StuckEngine],
) -> None:
    served, _ = stuck
    client = served.client
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.headers["retry-after"] == "5"
    assert "the engine did not answer within 0.05 s" in ready.text
    status = client.get("/status.json").json()
    assert (status["replicas"], status["state_cache"]) == (None, None)
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "clef_model_ready 1.0" in metrics.text
    assert "clef_cache_" not in metrics.text


def test_queries_stuck_on_the_cluster_take_a_few_threads_only(stuck: tuple[Served, StuckEngine]) -> None:
    served, engine = stuck
    client = served.client
    for _ in range(QUERY_THREADS):
        assert "did not answer within" in client.get("/ready").text
    # Every query thread still waits on the cluster: the next poll waits for one, in vain, and starts none.
    threads = sum(thread.name == "clef-engine-query" for thread in threading.enumerate())
    response = client.get("/ready")
    assert response.status_code == 503
    assert f"(the {QUERY_THREADS} there are still wait on earlier queries)" in response.text
    assert sum(thread.name == "clef-engine-query" for thread in threading.enumerate()) == threads
    # Answers again once the cluster does.
    engine.release.set()
    for thread in threading.enumerate():
        if thread.name == "clef-engine-query":
            thread.join()
    served.app.state.runtime.engine_queries.timeout_s = 5.0
    assert client.get("/ready").status_code == 200
