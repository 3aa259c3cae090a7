"""The job runner: a line's own error is recorded as its result; a failure that says the line could not run
now (every replica that tried it died, a full queue) leaves it unanswered and it is taken again."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from clef_runtime.engine.loop import QueueFullError
from clef_runtime.jobs.runner import JobRunner, RetryLaterError
from clef_runtime.jobs.store import JobLine, JobModel, JobRecord, JobStore, LineResult
from clef_runtime.server.errors import ApiError
from clef_runtime.server.settings import ServerSettings

if TYPE_CHECKING:
    from clef_runtime.scale.ray_serve import ReplicaAnswer

MODEL = JobModel("model-a", "/models/model-a")


def answer(state: str) -> dict[str, Any]:
    return {"model": "model-a", "answers": {"q": {"type": "noul", "noul": 0.5}}, "state": state}


class FlakyDispatcher:
    """Answers each request at once (the engine fails on the state "broken"), except that the futures of
    the first ``failures`` calls fail with ``error``. Counts the answers it computes."""

    def __init__(self, error: BaseException | None = None, failures: int = 0) -> None:
        self.error = error
        self.failures = failures
        self.calls = 0
        self.computed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def submit(self, request: dict[str, Any], tokens: int) -> Future[dict[str, Any]]:
        with self._lock:
            self.calls += 1
            failing = self.calls <= self.failures
        future: Future[dict[str, Any]] = Future()
        if failing and self.error is not None:
            future.set_exception(self.error)
        elif request["state"] == "broken":
            future.set_exception(ValueError("the engine failed on this line"))
        else:
            self.computed[request["state"]] += 1
            future.set_result(answer(request["state"]))
        return future


def prepare(request: Any) -> tuple[Any, int, dict[str, Any]]:
    return request, 1, {}


def job_lines(*states: str) -> list[JobLine]:
    return [JobLine(i, f"c{i}", json.dumps({"state": s})) for i, s in enumerate(states, start=1)]


def run_to_completion(
    store: JobStore, submit: Any, states: list[str], **runner_options: Any
) -> tuple[JobRecord, list[LineResult]]:
    record, _ = store.create("", job_lines(*states), model=MODEL, body_digest="d")
    runner = JobRunner(store, MODEL, prepare, submit, retry_delay_s=0.01, **runner_options)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while (job := store.get(record.id)) is not None and job.status != "completed":
            assert time.monotonic() < deadline, job
            time.sleep(0.01)
    finally:
        runner.stop()
    assert job is not None
    return job, store.results(job.id)


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    return JobStore(tmp_path / "jobs.sqlite3")


def test_a_line_no_replica_could_answer_is_retried_not_failed(store: JobStore) -> None:
    dispatcher = FlakyDispatcher(RetryLaterError("no model replica could answer"), failures=2)
    job, got = run_to_completion(store, dispatcher.submit, ["s1", "s2", "s3"])
    assert (job.done, job.failed) == (3, 0)
    assert [(r.line, r.ok, r.payload["state"]) for r in got] == [
        (1, True, "s1"),
        (2, True, "s2"),
        (3, True, "s3"),
    ]
    assert dispatcher.calls == 5  # the two that failed were submitted again


def test_a_full_queue_leaves_the_unsubmitted_lines_and_keeps_the_answers_in_flight(store: JobStore) -> None:
    dispatcher = FlakyDispatcher()
    full_once = [QueueFullError(8, 1.0)]

    def full_at_the_third_line(request: dict[str, Any], tokens: int) -> Future[dict[str, Any]]:
        if request["state"] == "s3" and full_once:
            raise full_once.pop()
        return dispatcher.submit(request, tokens)

    job, got = run_to_completion(store, full_at_the_third_line, ["s1", "s2", "s3", "s4"])
    assert (job.done, job.failed) == (4, 0) and [r.ok for r in got] == [True] * 4
    # Lines 1 and 2 were answered before the queue filled: recorded then, not computed a second time.
    assert dispatcher.computed == Counter({"s1": 1, "s2": 1, "s3": 1, "s4": 1})


def test_a_lines_own_error_is_its_result(store: JobStore) -> None:
    dispatcher = FlakyDispatcher()
    job, got = run_to_completion(store, dispatcher.submit, ["s1", "broken"])
    assert (job.done, job.failed) == (1, 1)
    assert got[1].payload == {
        "type": "internal_error",
        "message": "ValueError: the engine failed on this line",
    }


class Outcome:
    """A Ray response stub: ``result()`` returns the answer or raises the error."""

    def __init__(self, outcome: ReplicaAnswer | BaseException) -> None:
        self.outcome = outcome

    def result(self) -> ReplicaAnswer:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class DyingReplicas:
    """A Ray Serve handle stub: the first ``deaths`` calls find their replica dead, the others answer."""

    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.calls = 0
        self.decide = SimpleNamespace(remote=self._remote)

    def _remote(
        self,
        prepared: Any,
        *,
        state_key: str,
        background: bool,
        waited_s: float = 0.0,
        trace_context: dict[str, str] | None = None,
    ) -> Outcome:
        from ray.exceptions import ActorDiedError

        self.calls += 1
        if self.calls <= self.deaths:
            return Outcome(ActorDiedError())
        from clef_runtime.engine.contract import ReplicaReport
        from clef_runtime.scale.ray_serve import ReplicaAnswer

        # The dispatcher hands the decision on untouched: a dict stands in for it.
        decision: Any = answer(prepared.request["state"])
        return Outcome(ReplicaAnswer(ReplicaReport("r1", 1, {}), decision=decision))


def test_a_line_whose_two_replicas_died_under_ray_is_retried_not_failed(store: JobStore) -> None:
    from clef_runtime.scale.ray_serve import ReplicaDispatcher, ReplicaReports

    settings = ServerSettings(model="model-a")
    down = ReplicaDispatcher(DyingReplicas(deaths=2), settings, ReplicaReports())
    # An interactive request still gets its 503 with Retry-After.
    error = down.submit(SimpleNamespace(state_key=b"k", request={"state": "x"}), 1).exception(30)
    assert isinstance(error, ApiError) and error.status == 503 and error.headers["Retry-After"] == "5"
    down.close()

    handle = DyingReplicas(deaths=2)  # the first line's request and its retry both lose their replica
    dispatcher = ReplicaDispatcher(handle, settings, ReplicaReports())

    def submit(request: dict[str, Any], tokens: int) -> Future[dict[str, Any]]:
        return dispatcher.submit(SimpleNamespace(state_key=b"k", request=request), tokens, background=True)

    try:
        job, got = run_to_completion(store, submit, ["s1", "s2"], window=1)
    finally:
        dispatcher.close()
    assert (job.done, job.failed) == (2, 0) and [r.payload["state"] for r in got] == ["s1", "s2"]
    assert handle.calls == 4  # two deaths, then one answer per line
