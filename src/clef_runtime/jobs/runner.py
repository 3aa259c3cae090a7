"""The job runner: one thread that answers stored job lines through the engine loop's background lane.

It takes the oldest unfinished job of its model and that job's next lines without a result
(`JobStore.next_lines`; jobs submitted to another model are left queued for a server of that model),
prepares them (validation + encoding, as an interactive request), submits them as background items (they
run only when no interactive request waits or runs, see `clef_runtime.engine.policy`), and commits each
outcome as it arrives. A line whose answer was not committed when the process died has no result and is
taken again after the restart; a committed one is never recomputed: no line lost, none answered twice.

A line's error is recorded only when it is the line's own (invalid, too long, the engine failed on it). A
failure that says the line could not be run *now* (`TEMPORARY_FAILURES`: the scheduler closing, its queue
full, no replica able to answer) leaves the line without a result: it is taken again after a pause (or after
the restart), so an outage never fails job lines for good.

The runner knows no HTTP and holds no model: it is given the model's identity (`JobModel`), a ``prepare``
function and a ``submit`` function.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from clef_runtime.engine.decision import Decision
from clef_runtime.engine.loop import QueueFullError, SchedulerClosedError
from clef_runtime.jobs.store import JobModel, JobStore, JobStoreUnavailable
from clef_runtime.protocol.errors import ClefError, RequestValidationError

__all__ = ["TEMPORARY_FAILURES", "JobRunner", "RetryLaterError", "error_object"]

logger = logging.getLogger("clef_runtime.jobs")

#: Lines in flight at once: enough to keep background batches full, few enough that a cancel or a stop
#: drops little work.
DEFAULT_WINDOW = 8
#: Seconds to wait before taking lines again after a temporary failure (replicas restart within seconds).
DEFAULT_RETRY_DELAY_S = 5.0


class RetryLaterError(Exception):
    """Raised (by a ``submit`` or its future) when a request could not be answered now but may be shortly,
    e.g. every model replica that tried it died. A job line failing with it keeps no result and is retried."""


#: What ``submit`` or its future may raise without the line being at fault: the line stays unanswered.
TEMPORARY_FAILURES: tuple[type[BaseException], ...] = (SchedulerClosedError, QueueFullError, RetryLaterError)


def error_object(exc: BaseException) -> dict[str, Any]:
    """The ``error`` of a failed line: ``{"type", "message"}`` (+ ``detail`` for validation errors)."""
    if isinstance(exc, RequestValidationError):
        return {
            "type": exc.error_type,
            "message": exc.message,
            "detail": [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors],
        }
    if isinstance(exc, ClefError):
        return {"type": exc.error_type, "message": exc.message}
    return {"type": "internal_error", "message": f"{type(exc).__name__}: {exc}"}


class JobRunner:
    """Answers the job lines of ``model`` in the background. ``prepare(request_dict) -> (item, tokens,
    extras)`` validates and encodes one request (``extras`` are merged into the response, e.g.
    ``x_truncated_state_tokens``); ``submit(item, tokens) -> Future`` queues it in the engine's background
    lane. A failure in `TEMPORARY_FAILURES` leaves the line for a later try, ``retry_delay_s`` later."""

    def __init__(
        self,
        store: JobStore,
        model: JobModel,
        prepare: Callable[[Any], tuple[Any, int, dict[str, Any]]],
        submit: Callable[[Any, int], Future[Decision] | Future[dict[str, Any]]],
        *,
        window: int = DEFAULT_WINDOW,
        on_line: Callable[[bool], None] | None = None,
        retry_delay_s: float = DEFAULT_RETRY_DELAY_S,
    ) -> None:
        self.store = store
        self.model = model
        self._prepare = prepare
        self._submit = submit
        self._window = window
        self._on_line = on_line
        self._retry_delay_s = retry_delay_s
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()

    def start(self) -> None:
        """Start the runner thread (idempotent). The thread is published only once started: a `stop` racing
        a `start` (a server shut down while the model finished loading) must never join an unstarted one."""
        with self._thread_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="clef-jobs", daemon=True)
                thread.start()
                self._thread = thread

    def notify(self) -> None:
        """New work (a job was created or resumed): look now instead of at the next poll."""
        self._wake.set()

    def stop(self, timeout: float | None = 10) -> None:
        """Stop after the lines in flight (their futures fail when the engine loop closes; they stay
        unanswered in the store and are resumed after a restart)."""
        self._stopping.set()
        self._wake.set()
        with self._thread_lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        self._log_unfinished()
        while not self._stopping.is_set():
            try:
                worked = self._step()
            except JobStoreUnavailable as exc:
                logger.error("jobs paused: %s", exc)
                worked = False
                self._stopping.wait(5)
            except Exception:  # never let the runner die silently
                logger.exception("job runner error")
                worked = False
                self._stopping.wait(1)
            if not worked:
                self._wake.wait(1.0)
                self._wake.clear()

    def _log_unfinished(self) -> None:
        pending = self.store.unfinished_jobs()
        mine = [job.id for job in pending if job.model is not None and job.model.ref == self.model.ref]
        if mine:
            logger.info("resuming %d unfinished job(s): %s", len(mine), ", ".join(mine))
        others: dict[str, int] = {}
        for job in pending:
            if job.model is not None and job.model.ref != self.model.ref:
                others[job.model.label] = others.get(job.model.label, 0) + 1
        for label, count in sorted(others.items()):
            logger.warning(
                "%d unfinished job(s) were submitted to model %s, not %s: left queued for a server of that "
                "model",
                count,
                label,
                self.model.label,
            )

    def _step(self) -> bool:
        """Run one window of lines. Returns False when there was nothing to do."""
        found = self.store.next_lines(self._window, self.model)
        if found is None:
            return False
        job_id, lines = found
        self.store.mark_running(job_id)
        in_flight: list[tuple[int, Future[Any], dict[str, Any]]] = []
        deferred: BaseException | None = None
        for line in lines:
            try:
                request = json.loads(line.request or "null")
                item, tokens, extras = self._prepare(request)
            except ClefError as exc:
                self._record(job_id, line.line, False, error_object(exc))
                continue
            try:
                in_flight.append((line.line, self._submit(item, tokens), extras))
            except SchedulerClosedError:
                return False
            except TEMPORARY_FAILURES as exc:
                deferred = exc
                break  # the lines not submitted stay for the retry too
        for number, future, extras in in_flight:
            # Not started yet on a stop or a cancel: drop it (a stop leaves it for the restart).
            if (self._stopping.is_set() or self._cancelled(job_id)) and future.cancel():
                continue
            try:
                response = future.result()
            except TEMPORARY_FAILURES as exc:
                # Not the line's fault: it keeps no result and is taken again (after the restart when
                # shutting down).
                if not isinstance(exc, SchedulerClosedError):
                    deferred = exc
                continue
            except Exception as exc:
                self._record(job_id, number, False, error_object(exc))
                continue
            body = response.body() if isinstance(response, Decision) else response
            self._record(job_id, number, True, {**body, **extras})
        self.store.finish_if_done(job_id)
        if deferred is not None:
            delay = self._retry_delay_s
            logger.warning("job %s: lines left for a retry in %g s (%s)", job_id, delay, deferred)
            self._stopping.wait(delay)
        return True

    def _cancelled(self, job_id: str) -> bool:
        record = self.store.get(job_id)
        return record is None or record.status == "cancelled"

    def _record(self, job_id: str, line: int, ok: bool, payload: dict[str, Any]) -> None:
        if self.store.record_result(job_id, line, ok, payload) and self._on_line is not None:
            self._on_line(ok)
