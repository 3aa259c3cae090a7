"""The job runner: one thread that answers stored job lines through the batcher's background lane.

It takes the oldest unfinished job of its model and that job's next lines without a result
(`JobStore.next_lines`; jobs submitted to another model are left queued for a server of that model),
prepares them (validation + encoding, as an interactive request), submits them as background items (they
run only when no interactive request is waiting, see `clef_runtime.engine.scheduler`), and commits each
outcome as it arrives. A line whose answer was not committed when the process died has no result and is
taken again after the restart; a committed one is never recomputed: no line lost, none answered twice.

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

from clef_runtime.engine.scheduler import SchedulerClosedError
from clef_runtime.jobs.store import JobModel, JobStore, JobStoreUnavailable
from clef_runtime.protocol.errors import ClefError, RequestValidationError

__all__ = ["JobRunner", "error_object"]

logger = logging.getLogger("clef_runtime.jobs")

#: Lines in flight at once: enough to keep background batches full, few enough that a cancel or a stop
#: drops little work.
DEFAULT_WINDOW = 8


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
    ``x_truncated_state_tokens``); ``submit(item, tokens) -> Future`` queues it in the batcher's background
    lane."""

    def __init__(
        self,
        store: JobStore,
        model: JobModel,
        prepare: Callable[[Any], tuple[Any, int, dict[str, Any]]],
        submit: Callable[[Any, int], Future[dict[str, Any]]],
        *,
        window: int = DEFAULT_WINDOW,
        on_line: Callable[[bool], None] | None = None,
    ) -> None:
        self.store = store
        self.model = model
        self._prepare = prepare
        self._submit = submit
        self._window = window
        self._on_line = on_line
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the runner thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="clef-jobs", daemon=True)
            self._thread.start()

    def notify(self) -> None:
        """New work (a job was created or resumed): look now instead of at the next poll."""
        self._wake.set()

    def stop(self, timeout: float | None = 10) -> None:
        """Stop after the lines in flight (their futures fail when the batcher closes; they stay
        unanswered in the store and are resumed after a restart)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

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
        in_flight: list[tuple[int, Future[dict[str, Any]], dict[str, Any]]] = []
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
        for number, future, extras in in_flight:
            # Not started yet on a stop or a cancel: drop it (a stop leaves it for the restart).
            if (self._stopping.is_set() or self._cancelled(job_id)) and future.cancel():
                continue
            try:
                response = future.result()
            except SchedulerClosedError:
                # Shutting down: the line keeps no result and is resumed after the restart.
                continue
            except Exception as exc:
                self._record(job_id, number, False, error_object(exc))
                continue
            self._record(job_id, number, True, {**response, **extras})
        self.store.finish_if_done(job_id)
        return True

    def _cancelled(self, job_id: str) -> bool:
        record = self.store.get(job_id)
        return record is None or record.status == "cancelled"

    def _record(self, job_id: str, line: int, ok: bool, payload: dict[str, Any]) -> None:
        if self.store.record_result(job_id, line, ok, payload) and self._on_line is not None:
            self._on_line(ok)
