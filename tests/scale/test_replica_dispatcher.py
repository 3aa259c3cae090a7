"""The ingress's dispatcher to model replicas, with a fake deployment handle (no Ray cluster): the queue
timeout's outcome on a replica comes back as the same error a local engine raises, and the time a request
waited before its dispatch is handed on to the replica's queue."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from clef_runtime.engine.contract import ReplicaReport
from clef_runtime.engine.loop import QueueTimeoutError
from clef_runtime.scale.ray_serve import ClefModel, ReplicaAnswer, ReplicaDispatcher, ReplicaReports
from clef_runtime.server.settings import ServerSettings

REPORT = ReplicaReport("r1", 1, {})


class Outcome:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


class TimingOutReplica:
    """Every request waited past the replica's queue timeout; records the waits it was told of."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.decide = SimpleNamespace(remote=self._remote)

    def _remote(
        self,
        prepared: Any,
        *,
        state_key: str,
        background: bool,
        waited_s: float,
        trace_context: dict[str, str] | None,
    ) -> Outcome:
        assert trace_context is None  # the request is not traced
        self.waits.append(waited_s)
        return Outcome(ReplicaAnswer(REPORT, timeout=(waited_s + 0.25, 0.25, 3.0)))


def test_a_replica_queue_timeout_is_raised_at_the_ingress_with_the_wait_so_far() -> None:
    handle = TimingOutReplica()
    reports = ReplicaReports()
    dispatcher = ReplicaDispatcher(handle, ServerSettings(model="m", queue_timeout_ms=250), reports)
    try:
        future = dispatcher.submit(SimpleNamespace(state_key=b"k"), 10, waited_s=0.1)
        with pytest.raises(QueueTimeoutError) as info:
            future.result(10)
    finally:
        dispatcher.close()
    assert info.value.timeout_s == 0.25 and info.value.retry_after_s == 3.0
    (waited,) = handle.waits
    assert 0.1 <= waited < 0.1 + 5  # the ingress's own wait was added to what the request brought
    assert [report.replica for report in reports.running({"r1"})] == ["r1"]  # the report still counts


def test_the_wait_before_dispatch_counts() -> None:
    handle = TimingOutReplica()
    dispatcher = ReplicaDispatcher(handle, ServerSettings(model="m"), ReplicaReports())
    started = time.monotonic()
    try:
        with pytest.raises(QueueTimeoutError):
            dispatcher.submit(SimpleNamespace(state_key=b"k"), 10, waited_s=2.0).result(10)
    finally:
        dispatcher.close()
    assert 2.0 <= handle.waits[0] <= 2.0 + (time.monotonic() - started)


class TimedOutLoop:
    """A replica's engine loop whose every request has already waited past its queue timeout."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def submit(self, prepared: Any, tokens: int, *, background: bool, waited_s: float) -> Future[Any]:
        self.waits.append(waited_s)
        future: Future[Any] = Future()
        future.set_exception(QueueTimeoutError(waited_s + 0.5, 0.5, 4.0))
        return future

    def close(self, *args: Any, **options: Any) -> None:
        """The replica closes its loop when it is collected."""


def test_the_replicas_own_timeout_answer_reaches_the_ingress_as_the_same_error() -> None:
    # The real replica method (no Ray: the deployment is a plain class until `serve.deployment` wraps it).
    replica = object.__new__(ClefModel)
    replica.loop = TimedOutLoop()  # type: ignore[assignment]
    replica.replica_id = "r1"
    replica.engine = SimpleNamespace(cache_stats=lambda: {})  # type: ignore[assignment]

    def remote(prepared: Any, **options: Any) -> Outcome:
        return Outcome(asyncio.run(replica.decide(prepared, **options)))

    handle = SimpleNamespace(decide=SimpleNamespace(remote=remote))
    reports = ReplicaReports()
    dispatcher = ReplicaDispatcher(handle, ServerSettings(model="m", queue_timeout_ms=500), reports)
    prepared = SimpleNamespace(state_key=b"k", record=SimpleNamespace(input_tokens=10))
    try:
        with pytest.raises(QueueTimeoutError) as info:
            dispatcher.submit(prepared, 10, waited_s=0.2).result(10)
    finally:
        dispatcher.close()
    (waited,) = replica.loop.waits  # type: ignore[attr-defined]
    assert waited >= 0.2
    assert (info.value.waited_s, info.value.timeout_s, info.value.retry_after_s) == (waited + 0.5, 0.5, 4.0)
    assert [report.replica for report in reports.running({"r1"})] == ["r1"]
