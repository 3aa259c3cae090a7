"""The engine loop: requests in, one step at a time on one thread, every answer out as soon as it is done.

The loop knows nothing about HTTP. `EngineLoop.submit` queues a prepared request and returns a
:class:`concurrent.futures.Future` of its `Decision`. One worker thread (the one that owns the model and its
CPU thread team) repeats: take what arrived, ask the policy (`clef_runtime.engine.policy`) for the next
step, run it with the runner (`StepRunner`: `clef_runtime.engine.executor.StepExecutor` for a loaded model),
and resolve the futures of the requests that completed in it, each at the moment its own work is done.

Why one worker thread: the model's forward pass is the bottleneck and already uses every core through
torch's intra-op threads; two steps at once would only make both slower and double peak memory.

* Cancellation: a request whose future is cancelled (its client went away) leaves the queue at once, or
  its batch between two chunks; nothing of it is stored.
* Failure isolation: when a batch raises, its requests are retried one by one, each alone, so only the
  failing one gets the error.
* Lanes: ``background=True`` requests (batch-job lines) wait in their own lane with its own bound and run
  only when no interactive work is waiting or running (the policy's rule); closing fails them (their owner
  keeps them durably and resumes them after a restart) while interactive requests are drained.
* Queue timeout: with ``queue_timeout_s`` an interactive request that has waited that long without
  starting fails with `QueueTimeoutError` at that moment (a timer thread watches the deadlines while the
  worker computes a step) and is never computed afterwards; a request admitted into a step has always
  waited less. Background requests have no deadline: they wait in their own lane by design.
* Timing: every decision carries its queue time, compute time and the number of steps it took part in.
* Drain estimate (a refusal's Retry-After): the steps the work ahead needs (its tokens over the step's token
  budget, its requests over the step's rows) times the recent step time (an average weighted to the last
  steps). Steps cost about the same whatever they hold: multiplying a per-token cost measured on small
  steps by the tokens of a long queue overstated the drain of batched steps several times over.

`EngineLoop.run_until_idle` runs the same steps on the calling thread without a worker: the synchronous
`Clef.decide_encoded` uses it.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from clef_runtime.engine.decision import Decision
from clef_runtime.engine.policy import Admit, Running, Step, StepSettings, Waiting, compose_step

__all__ = [
    "EngineLoop",
    "Estimate",
    "QueueFullError",
    "QueueTimeoutError",
    "RunningBatch",
    "SchedulerClosedError",
    "StepRunner",
    "StepStats",
    "WholeRequestRunner",
]

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The bounded queue is full; the caller should retry later (HTTP 429).

    ``retry_after_s`` is the loop's estimate of how long the work now queued takes to clear.
    """

    def __init__(self, queued: int, retry_after_s: float) -> None:
        super().__init__(f"the request queue is full ({queued} waiting)")
        self.queued = queued
        self.retry_after_s = retry_after_s


class QueueTimeoutError(RuntimeError):
    """A request waited ``waited_s`` seconds without starting, over the loop's queue timeout; it was never
    computed (HTTP 503). ``retry_after_s`` is the loop's estimate of how long the work queued then takes."""

    def __init__(self, waited_s: float, timeout_s: float, retry_after_s: float) -> None:
        super().__init__(
            f"the request waited {waited_s * 1000:.0f} ms without starting (queue timeout "
            f"{timeout_s * 1000:.0f} ms)"
        )
        self.waited_s = waited_s
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s


class SchedulerClosedError(RuntimeError):
    """The loop is shutting down and accepts no new requests (or dropped a waiting one)."""


@dataclass(frozen=True)
class Estimate:
    """How the policy sees a request before it starts: ``tokens`` to compute, ``group`` (its start point:
    requests with equal groups can share a batch) and ``hold`` (its state: None when it cannot be shared)."""

    tokens: int
    group: Hashable = None
    hold: Hashable | None = None


class RunningBatch(Protocol):
    """Admitted requests computed together; rows are keyed by their index in the admitted list."""

    def remaining(self) -> dict[int, int]:
        """Tokens every row still in the batch has to compute."""
        ...

    def drop(self, indexes: Iterable[int]) -> None:
        """Take rows out without completing them."""
        ...


class StepRunner(Protocol):
    """What the loop needs of an engine."""

    def estimate(self, item: Any) -> Estimate:
        """The policy's view of ``item`` (may raise for an item that cannot run)."""
        ...

    def admit(
        self, items: Sequence[Any], *, share: Collection[Hashable] = (), held: Collection[int] = ()
    ) -> Sequence[RunningBatch]:
        """Start ``items`` as one or more batches. ``share``: states that waiting requests want kept;
        ``held``: indexes of items that waited for another request's state."""
        ...

    def advance(self, batch: Any, tokens: int) -> dict[int, Decision]:
        """Compute the next ``tokens`` tokens of every row of ``batch`` (one `admit` returned); returns the
        decisions of the rows that completed (they leave the batch)."""
        ...


@dataclass(frozen=True)
class StepStats:
    """What one step did; passed to the ``on_step`` observer."""

    rows: int
    """Rows (requests) computed in the step."""
    tokens: int
    """Padded tokens planned (rows x tokens of every part)."""
    seconds: float
    admitted: int
    completed: int
    failed: bool
    """A part of the step raised (its requests were retried alone, or failed)."""


@dataclass(eq=False)
class _Entry:
    item: Any
    seq: int
    background: bool
    submitted: float
    work_at_arrival: int
    deadline: float | None = None
    """When it times out if it has not started (seconds on the loop's clock; None: never)."""
    future: Future[Decision] = field(default_factory=Future)
    estimate: Estimate | None = None
    alone: bool = False
    held: bool = False
    started: float | None = None
    steps: int = 0
    step_times: list[tuple[float, float]] = field(default_factory=list)
    """Start and end of each advance of its batch (on the loop's clock), for its timings."""


@dataclass(eq=False)
class _TrackedBatch:
    """A batch the runner admitted, as the loop keeps it: the runner's handle and the entries of its rows."""

    key: int
    handle: RunningBatch
    entries: dict[int, _Entry]
    seq: int
    work_at_arrival: int
    background: bool
    remaining_tokens: int = 0
    """Tokens its rows had left at the last step (read by other threads: the handle is the worker's)."""


class EngineLoop:
    """Runs a `StepRunner` in steps on one worker thread (see the module docstring).

    ``on_step(stats)`` observes every step; ``on_thread_start()`` runs first on the worker thread (e.g. the
    engine's ``prepare_compute_thread``; an exception there is logged and the worker goes on).
    ``queue_timeout_s`` bounds how long an interactive request may wait without starting (None: no bound);
    ``on_timeout(error)`` observes every request it fails. ``clock`` is the loop's time: queue deadlines,
    queue and compute times, the steps for the drain estimate (tests pass a clock of their own, so that no
    test depends on how fast a loaded machine schedules the threads).
    """

    def __init__(
        self,
        runner: StepRunner,
        settings: StepSettings,
        *,
        max_queue: int = 256,
        max_background: int = 1024,
        on_step: Callable[[StepStats], object] | None = None,
        on_thread_start: Callable[[], None] | None = None,
        queue_timeout_s: float | None = None,
        on_timeout: Callable[[QueueTimeoutError], None] | None = None,
        name: str = "clef-engine",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_queue < 1 or max_background < 1:
            raise ValueError("max_queue and max_background must be at least 1")
        if queue_timeout_s is not None and queue_timeout_s <= 0:
            raise ValueError("queue_timeout_s must be positive (or None)")
        self.runner = runner
        self.settings = settings
        self.max_queue = max_queue
        self.max_background = max_background
        self._on_step = on_step
        self._on_thread_start = on_thread_start
        self.queue_timeout_s = queue_timeout_s
        self._on_timeout = on_timeout
        self._name = name
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._batch_keys = itertools.count()
        self._inbox: list[_Entry] = []
        self._waiting: list[_Entry] = []
        self._batches: dict[Hashable, _TrackedBatch] = {}  # by key: the policy's keys are opaque Hashables
        self._work_done = 0
        self._closing = False
        self._drain = True
        self._thread: threading.Thread | None = None
        self._timer: threading.Thread | None = None
        self._seconds_per_step = 0.0
        self._clock = clock

    # ------------------------------------------------------------------------------------------ public

    def start(self) -> None:
        """Start the worker thread (idempotent). Raises `SchedulerClosedError` after `close`."""
        with self._cond:
            if self._closing:
                raise SchedulerClosedError("the engine loop is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._worker, name=self._name, daemon=True)
            self._thread.start()
            if self.queue_timeout_s is not None:
                self._timer = threading.Thread(
                    target=self._expire_on_time, name=f"{self._name}-timeout", daemon=True
                )
                self._timer.start()

    def submit(
        self, item: Any, tokens: int | None = None, *, background: bool = False, waited_s: float = 0.0
    ) -> Future[Decision]:
        """Queue one prepared request; returns the future of its `Decision` (cancel it to drop the request,
        waiting or running). ``tokens`` is accepted for callers that know it and otherwise unused: the
        runner estimates the work itself. ``waited_s``: how long the request already waited before it came
        here (reading, validation, another queue); it counts against the queue timeout. Raises
        `QueueFullError` when ``max_queue`` interactive (or ``max_background`` background) requests are
        waiting, `SchedulerClosedError` after `close`."""
        with self._cond:
            if self._closing:
                raise SchedulerClosedError("the server is shutting down")
            self._sweep_waiting()
            waiting = sum(1 for e in (*self._inbox, *self._waiting) if e.background == background)
            bound = self.max_background if background else self.max_queue
            if waiting >= bound:
                raise QueueFullError(waiting, self._estimate_wait_locked())
            now = self._clock()
            timeout = None if background else self.queue_timeout_s
            deadline = None if timeout is None else now + timeout - max(0.0, waited_s)
            entry = _Entry(item, next(self._seq), background, now, self._work_done, deadline)
            self._inbox.append(entry)
            self._cond.notify_all()
        return entry.future

    def wake(self) -> None:
        """Re-check for work now."""
        with self._cond:
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        """Interactive requests waiting (not started yet)."""
        with self._cond:
            return sum(1 for e in (*self._inbox, *self._waiting) if not e.background)

    @property
    def background_depth(self) -> int:
        """Background requests waiting."""
        with self._cond:
            return sum(1 for e in (*self._inbox, *self._waiting) if e.background)

    @property
    def running(self) -> int:
        """Requests being computed (admitted, not complete)."""
        with self._cond:
            return sum(len(batch.entries) for batch in self._batches.values())

    @property
    def closed(self) -> bool:
        """True once `close` was called."""
        return self._closing

    def estimated_wait_s(self) -> float:
        """Seconds the work now queued and running would take, by the recent seconds per token."""
        with self._cond:
            return self._estimate_wait_locked()

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests. With ``drain`` the interactive requests accepted are still answered;
        background ones (and, without ``drain``, every one) fail with `SchedulerClosedError`. Waits up to
        ``timeout`` seconds for the worker to finish."""
        with self._cond:
            self._closing = True
            self._drain = self._drain and drain
            for entry in (*self._inbox, *self._waiting):
                if entry.background or not drain:
                    _fail(entry, SchedulerClosedError("the server shut down"))
            self._inbox = [e for e in self._inbox if not e.future.done()]
            self._waiting = [e for e in self._waiting if not e.future.done()]
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        elif thread is None:
            # Never started: nothing will run what is left, so fail it rather than hang callers.
            self._fail_running(SchedulerClosedError("the engine loop was closed before it started"))

    def run_until_idle(self) -> None:
        """Run steps on the calling thread until nothing is waiting or running (a loop without a worker:
        `Clef.decide_encoded`). Raises RuntimeError when the worker thread was started."""
        if self._thread is not None:
            raise RuntimeError("the loop has a worker thread; run_until_idle is for loops without one")
        while True:
            with self._cond:
                if not self._has_work_locked():
                    return
            if not self._step():
                # The policy always runs something while work is left; a step without parts is a bug, and
                # looping on it would hang the caller.
                self._fail_running(RuntimeError("the engine made no progress"))
                return

    # ---------------------------------------------------------------------------------------- internals

    def _estimate_wait_locked(self) -> float:
        """Seconds until the work now queued and running is done (see "Drain estimate" above)."""
        queued = sum(e.estimate.tokens if e.estimate else 0 for e in self._waiting)
        queued += sum(_input_tokens(e.item) for e in self._inbox)
        running = sum(b.remaining_tokens for b in self._batches.values())
        if not self._seconds_per_step:  # no step measured yet: a nominal cost per token
            # At least one step: a full queue always has that much ahead of it.
            return max(queued + running, self.settings.max_step_tokens) * 1e-3
        requests = len(self._waiting) + len(self._inbox)
        requests += sum(len(b.entries) for b in self._batches.values())
        steps = max(
            1,
            math.ceil((queued + running) / self.settings.max_step_tokens),
            math.ceil(requests / self.settings.max_rows),
        )
        return steps * self._seconds_per_step

    def _expire_locked(self, now: float) -> list[QueueTimeoutError]:
        """Fail every waiting request whose deadline has passed (it is never computed). Returns the errors,
        for the observer (called outside the lock)."""
        expired = [
            e
            for e in (*self._inbox, *self._waiting)
            if e.deadline is not None and e.deadline <= now and not e.future.done()
        ]
        if not expired:
            return []
        self._inbox = [e for e in self._inbox if e not in expired]
        self._waiting = [e for e in self._waiting if e not in expired]
        retry_after = self._estimate_wait_locked()
        errors = []
        for entry in expired:
            timeout = self.queue_timeout_s or 0.0
            waited = now - entry.deadline + timeout if entry.deadline is not None else now - entry.submitted
            error = QueueTimeoutError(waited, timeout, retry_after)
            _fail(entry, error)
            errors.append(error)
        return errors

    def _observe_timeouts(self, errors: list[QueueTimeoutError]) -> None:
        if self._on_timeout is None:
            return
        for error in errors:
            try:
                self._on_timeout(error)
            except Exception:  # an observer bug must not stop the timer
                logger.exception("on_timeout observer failed")

    def _expire_on_time(self) -> None:
        """The timer thread: fail requests at their deadline, also while the worker computes a step."""
        while True:
            with self._cond:
                if self._closing and not self._has_work_locked():
                    return
                now = self._clock()
                errors = self._expire_locked(now)
                deadlines = [
                    e.deadline
                    for e in (*self._inbox, *self._waiting)
                    if e.deadline is not None and not e.future.done()
                ]
                if not errors:
                    # Woken by every submission and step (notify_all), else at the earliest deadline.
                    self._cond.wait(None if not deadlines else max(0.0, min(deadlines) - now) + 1e-3)
            self._observe_timeouts(errors)

    def _has_work_locked(self) -> bool:
        return bool(self._inbox or self._waiting or self._batches)

    def _worker(self) -> None:
        if self._on_thread_start is not None:
            try:
                self._on_thread_start()
            except Exception:  # a slower thread is better than no worker: callers would hang forever
                logger.exception("engine thread start hook failed")
        while True:
            with self._cond:
                while not self._has_work_locked() and not self._closing:
                    self._cond.wait()
                if not self._has_work_locked():
                    return  # closing and drained
                if self._closing and not self._drain:
                    self._fail_running_locked(SchedulerClosedError("the server shut down"))
                    return
            try:
                if not self._step():
                    with self._cond:  # nothing could run now (e.g. only cancelled requests were left)
                        self._cond.wait(0.05)
            except BaseException:  # never let the worker die: callers would hang forever
                logger.exception("engine loop error")
                self._fail_running(RuntimeError("internal engine loop error"))

    def _sweep_waiting(self) -> None:
        # Done while waiting: cancelled by its client, or failed by its deadline.
        self._waiting = [e for e in self._waiting if not e.future.done()]
        self._inbox = [e for e in self._inbox if not e.future.done()]

    def _take_arrivals(self) -> None:
        """Estimate what arrived (outside the lock: the runner looks the state cache up)."""
        with self._cond:
            arrived, self._inbox = self._inbox, []
        ready = []
        for entry in arrived:
            if entry.future.done():  # timed out or cancelled while in transit
                continue
            try:
                entry.estimate = self.runner.estimate(entry.item)
            except Exception as exc:
                _fail(entry, exc)
                continue
            ready.append(entry)
        with self._cond:
            self._waiting.extend(ready)
            self._waiting.sort(key=lambda e: e.seq)

    def _views(self) -> tuple[list[Waiting], list[Running]]:
        waiting = []
        for entry in self._waiting:
            estimate = entry.estimate
            assert estimate is not None
            waiting.append(
                Waiting(
                    key=entry.seq,
                    tokens=estimate.tokens,
                    seq=entry.seq,
                    work_at_arrival=entry.work_at_arrival,
                    background=entry.background,
                    group=estimate.group,
                    hold=estimate.hold,
                    alone=entry.alone,
                )
            )
        running = []
        for batch in self._batches.values():
            remaining = batch.handle.remaining()
            batch.remaining_tokens = sum(remaining.values())
            running.append(
                Running(
                    key=batch.key,
                    remaining=tuple(remaining[i] for i in batch.entries),
                    seq=batch.seq,
                    work_at_arrival=batch.work_at_arrival,
                    background=batch.background,
                    holds=frozenset(
                        e.estimate.hold for e in batch.entries.values() if e.estimate and e.estimate.hold
                    ),
                )
            )
        return waiting, running

    def _step(self) -> bool:
        """Run one step. Returns False when work is left but nothing could run."""
        self._take_arrivals()
        self._drop_cancelled_rows()
        with self._cond:
            # The admission time is taken before the deadlines are checked, and the admitted requests leave
            # the waiting list in the same locked section: every request admitted by this step has waited
            # less than the queue timeout (its queue time says so) and the timer cannot fail it any more.
            now = self._clock()
            timeouts = self._expire_locked(now)
            self._sweep_waiting()
            step = Step()
            if self._waiting or self._batches:
                waiting, running = self._views()
                step = compose_step(waiting, running, work_done=self._work_done, settings=self.settings)
            if step:
                by_seq: dict[Hashable, _Entry] = {e.seq: e for e in self._waiting}
                admitted = {key for part in step.parts if isinstance(part, Admit) for key in part.keys}
                self._waiting = [e for e in self._waiting if e.seq not in admitted]
                wanted = {
                    e.estimate.hold for e in self._waiting if e.estimate and e.estimate.hold is not None
                }
                busy = {hold for view in running for hold in view.holds}
                busy |= {estimate.hold for k in admitted if (estimate := by_seq[k].estimate)}
                for entry in self._waiting:
                    if entry.estimate is not None and entry.estimate.hold in busy:
                        entry.held = True
            idle = not self._waiting and not self._batches
        self._observe_timeouts(timeouts)
        if not step:
            return idle  # idle: nothing left (new arrivals are taken by the next step)
        completed, failed = self._run(step, by_seq, wanted, now)
        seconds = self._clock() - now
        with self._cond:
            self._work_done += step.tokens
            if step.tokens:
                self._seconds_per_step = (
                    seconds if not self._seconds_per_step else 0.8 * self._seconds_per_step + 0.2 * seconds
                )
            if completed:
                self._reestimate_held_locked()
            self._cond.notify_all()
        if self._on_step is not None:
            stats = StepStats(step.rows, step.tokens, seconds, len(admitted), completed, failed)
            try:
                self._on_step(stats)
            except Exception:  # an observer bug must not fail requests
                logger.exception("on_step observer failed")
        return True

    def _reestimate_held_locked(self) -> None:
        """Requests that waited for a state being computed: look again (it may be cached now)."""
        for entry in self._waiting:
            if entry.held:
                try:
                    entry.estimate = self.runner.estimate(entry.item)
                except Exception as exc:  # the same call succeeded at arrival; keep the old figure
                    logger.debug("re-estimating a held request failed: %s", exc)

    def _run(
        self, step: Step, by_seq: dict[Hashable, _Entry], wanted: set[Hashable], started: float
    ) -> tuple[int, bool]:
        """Run the parts of ``step`` in order; returns (requests completed, whether a part failed)."""
        completed, failed = 0, False
        for part in step.parts:
            if isinstance(part, Admit):
                entries = [by_seq[key] for key in part.keys]
                for entry in entries:
                    entry.started = entry.started or started
                batches = self._admit(entries, wanted)
                if batches is None:
                    failed = True
                    continue
                targets = batches
            else:
                batch = self._batches.get(part.key)
                if batch is None:
                    continue
                targets = [batch]
            for batch in targets:
                done, ok = self._advance(batch, part.tokens)
                completed += done
                failed = failed or not ok
        return completed, failed

    def _admit(self, entries: list[_Entry], wanted: set[Hashable]) -> list[_TrackedBatch] | None:
        held = [i for i, e in enumerate(entries) if e.held]
        try:
            handles = self.runner.admit([e.item for e in entries], share=wanted, held=held)
        except Exception as exc:
            self._isolate(entries, exc)
            return None
        batches = []
        for handle in handles:
            own = {index: entries[index] for index in handle.remaining()}
            first = min(own.values(), key=lambda e: e.seq)
            batch = _TrackedBatch(
                next(self._batch_keys),
                handle,
                own,
                first.seq,
                first.work_at_arrival,
                all(e.background for e in own.values()),
            )
            with self._cond:
                self._batches[batch.key] = batch
            batches.append(batch)
        return batches

    def _advance(self, batch: _TrackedBatch, tokens: int) -> tuple[int, bool]:
        for entry in batch.entries.values():
            entry.steps += 1
        began = self._clock()
        try:
            decisions = self.runner.advance(batch.handle, tokens)
        except Exception as exc:
            with self._cond:
                self._batches.pop(batch.key, None)
            self._isolate(list(batch.entries.values()), exc)
            return 0, False
        now = self._clock()
        for entry in batch.entries.values():
            entry.step_times.append((began, now))
        for index, decision in decisions.items():
            entry = batch.entries.pop(index)
            started = entry.started or now
            timings = replace(
                decision.timings,
                queue_s=started - entry.submitted,
                compute_s=now - started,
                steps=entry.steps,
                submitted_at=entry.submitted,
                step_times=tuple(entry.step_times),
            )
            if entry.future.set_running_or_notify_cancel():
                entry.future.set_result(replace(decision, timings=timings))
        if not batch.entries:
            with self._cond:
                self._batches.pop(batch.key, None)
        return len(decisions), True

    def _isolate(self, entries: list[_Entry], exc: Exception) -> None:
        """A batch of ``entries`` failed: retry them one by one (alone), or fail the only one."""
        live = [e for e in entries if not e.future.cancelled()]
        if len(live) == 1 and (live[0].alone or len(entries) == 1):
            _fail(live[0], exc)
            return
        logger.warning("a batch of %d failed (%s); retrying its requests one by one", len(entries), exc)
        with self._cond:
            for entry in live:
                entry.alone = True
                entry.held = False
                self._waiting.append(entry)
            self._waiting.sort(key=lambda e: e.seq)

    def _drop_cancelled_rows(self) -> None:
        with self._cond:
            batches = list(self._batches.values())
        for batch in batches:
            gone = [index for index, entry in batch.entries.items() if entry.future.cancelled()]
            if not gone:
                continue
            batch.handle.drop(gone)
            for index in gone:
                del batch.entries[index]
            if not batch.entries:
                with self._cond:
                    self._batches.pop(batch.key, None)

    def _fail_running(self, exc: BaseException) -> None:
        with self._cond:
            self._fail_running_locked(exc)

    def _fail_running_locked(self, exc: BaseException) -> None:
        for batch in self._batches.values():
            for entry in batch.entries.values():
                _fail(entry, exc)
        self._batches.clear()
        for entry in (*self._inbox, *self._waiting):
            _fail(entry, exc)
        self._inbox, self._waiting = [], []
        self._cond.notify_all()


def _input_tokens(item: Any) -> int:
    """The input tokens of a prepared request not estimated yet (0 when it does not say)."""
    record = getattr(item, "record", None)
    return int(getattr(record, "input_tokens", 0))


def _fail(entry: _Entry, exc: BaseException) -> None:
    if entry.future.set_running_or_notify_cancel():
        entry.future.set_exception(exc)


class WholeRequestRunner:
    """A `StepRunner` for an engine that answers whole requests only (``decide(items) -> decisions``): an
    admitted batch completes in its first advance, whatever the step's tokens. ``tokens(item)`` is the
    work of an item (its input tokens)."""

    def __init__(
        self, decide: Callable[[list[Any]], Sequence[Decision]], tokens: Callable[[Any], int]
    ) -> None:
        self._decide = decide
        self._tokens = tokens

    def estimate(self, item: Any) -> Estimate:
        return Estimate(self._tokens(item))

    def admit(
        self, items: Sequence[Any], *, share: Collection[Hashable] = (), held: Collection[int] = ()
    ) -> list[RunningBatch]:
        return [_WholeBatch(self._tokens, dict(enumerate(items)))]

    def advance(self, batch: _WholeBatch, tokens: int) -> dict[int, Decision]:
        indexes = list(batch.items)
        decisions = list(self._decide([batch.items[i] for i in indexes]))
        if len(decisions) != len(indexes):
            raise RuntimeError(f"the engine returned {len(decisions)} decisions for {len(indexes)} requests")
        batch.items = {}
        return dict(zip(indexes, decisions, strict=True))


@dataclass(eq=False)
class _WholeBatch:
    """Requests a `WholeRequestRunner` answers together, each whole, in the batch's first advance."""

    tokens: Callable[[Any], int]
    items: dict[int, Any]

    def remaining(self) -> dict[int, int]:
        return {index: self.tokens(item) for index, item in self.items.items()}

    def drop(self, indexes: Iterable[int]) -> None:
        for index in indexes:
            self.items.pop(index, None)
