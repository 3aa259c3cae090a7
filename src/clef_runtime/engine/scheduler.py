"""A dynamic batcher: concurrent requests in, batched calls of one function out.

The scheduler knows nothing about HTTP or about the model. Each submitted item has a payload and a token
count; one worker thread collects items for a short window, picks batches (oldest item first, followers
of similar length, within a padded-token budget) and calls ``run_batch(payloads) -> results`` on them. The
caller gets a :class:`concurrent.futures.Future` per item.

Why one worker thread: the model's forward pass is the bottleneck and already uses every core through
torch's intra-op threads; running two batches at once would only make both slower and double peak memory.

Rules, in order of importance:

* Fairness: the oldest waiting item is always in the next batch, so no item starves behind a stream of
  better-fitting ones.
* Padding: the engine pads a batch to its longest item, so a batch costs ``longest * count`` tokens. A
  follower joins only while that stays within ``max_batch_tokens`` and the longest/shortest ratio stays
  within ``length_ratio``. An item longer than the budget still runs, alone.
* Latency: the collection window is only waited while more items are on their way. The caller can say
  how many are (``arrivals``: e.g. HTTP requests whose bodies are still being read and encoded); with none
  on the way, a lone item runs at once instead of idling for the window.
* Cancellation: an item whose future was cancelled (its client went away) is dropped before it costs
  compute.
* Failure isolation: if a batch raises, its items are retried one by one so only the failing item gets
  the error.
* Deterministic mode: every item runs alone, in arrival order, so its result never depends on what else
  was waiting (batch composition changes padding and therefore floating-point results slightly).
* Priority: items submitted with ``background=True`` (batch-job lines) wait in their own lane, outside
  ``max_queue``. They run only when no interactive item is waiting or on its way, in small batches
  (``background_batch_size``), so an interactive request that arrives meanwhile waits at most for one
  small batch; they are never mixed into an interactive batch (that would make it slower).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "BatchStats",
    "DynamicBatcher",
    "QueueFullError",
    "SchedulerClosedError",
]

logger = logging.getLogger(__name__)

P = TypeVar("P")
R = TypeVar("R")


class QueueFullError(RuntimeError):
    """The bounded queue is full; the caller should retry later (HTTP 429).

    ``retry_after_s`` is the scheduler's estimate of how long the current queue takes to clear.
    """

    def __init__(self, queued: int, retry_after_s: float) -> None:
        super().__init__(f"the request queue is full ({queued} waiting)")
        self.queued = queued
        self.retry_after_s = retry_after_s


class SchedulerClosedError(RuntimeError):
    """The scheduler is shutting down and accepts no new items (or dropped a waiting one)."""


@dataclass(frozen=True)
class BatchStats:
    """What one call of ``run_batch`` did; passed to the ``on_batch`` observer."""

    size: int
    """Items in the batch."""
    padded_tokens: int
    """``longest item * size``: the tokens the engine computes with right-padding."""
    real_tokens: int
    """Sum of the items' own token counts."""
    seconds: float
    """Wall time of the ``run_batch`` call."""
    failed: bool
    """True when the batched call raised (its items were then retried one by one)."""


@dataclass(eq=False)
class _Item(Generic[P, R]):
    payload: P
    tokens: int
    seq: int
    enqueued_at: float
    future: Future[R] = field(default_factory=Future)


class DynamicBatcher(Generic[P, R]):
    """Collect submitted items into batches and run them on one worker thread.

    ``run_batch`` receives a list of payloads and must return one result per payload, in order. It runs on
    the worker thread only, never concurrently with itself.
    """

    def __init__(
        self,
        run_batch: Callable[[list[P]], Sequence[R]],
        *,
        max_queue: int = 256,
        max_batch_tokens: int = 16384,
        max_batch_size: int = 32,
        window_s: float = 0.005,
        length_ratio: float = 2.0,
        deterministic: bool = False,
        on_batch: Callable[[BatchStats], None] | None = None,
        arrivals: Callable[[], int] | None = None,
        name: str = "clef-batcher",
        background_batch_size: int = 4,
        max_background: int = 1024,
        on_thread_start: Callable[[], None] | None = None,
    ) -> None:
        """Configure the batcher; call :meth:`start` to launch the worker.

        ``on_thread_start()`` (optional) runs first on the worker thread, the one that calls ``run_batch``
        (e.g. the engine's ``prepare_compute_thread``); an exception there is logged, and the worker goes on.

        ``arrivals()`` (optional) returns how many items are about to be submitted; the window is skipped
        while it returns 0. Without it the window is always waited. Call :meth:`wake` when it drops.

        Raises ``ValueError`` on a non-positive limit or a ``length_ratio`` below 1.
        """
        if max_queue < 1 or max_batch_tokens < 1 or max_batch_size < 1:
            raise ValueError("max_queue, max_batch_tokens and max_batch_size must be at least 1")
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        if length_ratio < 1:
            raise ValueError("length_ratio must be >= 1")
        if background_batch_size < 1 or max_background < 1:
            raise ValueError("background_batch_size and max_background must be at least 1")
        self._run_batch = run_batch
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = 1 if deterministic else max_batch_size
        self.window_s = 0.0 if deterministic else window_s
        self.length_ratio = length_ratio
        self.deterministic = deterministic
        self._on_batch = on_batch
        self._arrivals = arrivals
        self._on_thread_start = on_thread_start
        self._name = name
        self._pending: list[_Item[P, R]] = []  # arrival order
        self._background: list[_Item[P, R]] = []  # arrival order; runs only when _pending is empty
        self.background_batch_size = 1 if deterministic else background_batch_size
        self.max_background = max_background
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._closing = False
        self._running_items = 0
        self._thread: threading.Thread | None = None
        # Exponential moving average of compute seconds per item, for Retry-After estimates.
        self._seconds_per_item = 0.0

    # ------------------------------------------------------------------------------------------ public

    def start(self) -> None:
        """Start the worker thread (idempotent). Raises :class:`SchedulerClosedError` after :meth:`close`."""
        with self._cond:
            if self._closing:
                raise SchedulerClosedError("the scheduler is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._worker, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, payload: P, tokens: int, *, background: bool = False) -> Future[R]:
        """Queue one item and return the future of its result.

        ``background`` items (batch-job lines) go to the low-priority lane (see the module docstring).
        Cancel the future to drop the item if it has not started yet. Raises :class:`QueueFullError` when
        ``max_queue`` interactive items (or ``max_background`` background items) are already waiting and
        :class:`SchedulerClosedError` after :meth:`close`.
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        with self._cond:
            if self._closing:
                raise SchedulerClosedError("the server is shutting down")
            self._drop_cancelled()
            lane, bound = (
                (self._background, self.max_background) if background else (self._pending, self.max_queue)
            )
            if len(lane) >= bound:
                raise QueueFullError(len(lane), self._estimate_wait_locked())
            item: _Item[P, R] = _Item(payload, int(tokens), next(self._seq), time.monotonic())
            lane.append(item)
            self._cond.notify_all()
        return item.future

    def wake(self) -> None:
        """Re-check the collection window now (call when the ``arrivals`` count dropped)."""
        with self._cond:
            self._cond.notify_all()

    @property
    def queue_depth(self) -> int:
        """Items waiting (not yet running), cancelled ones included until the worker sweeps them."""
        with self._cond:
            return len(self._pending)

    @property
    def background_depth(self) -> int:
        """Background items waiting."""
        with self._cond:
            return len(self._background)

    @property
    def running(self) -> int:
        """Items in the batch being computed right now."""
        with self._cond:
            return self._running_items

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closing

    def estimated_wait_s(self) -> float:
        """Seconds the items now waiting would take to clear, by the recent per-item compute time."""
        with self._cond:
            return self._estimate_wait_locked()

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting items. With ``drain`` the waiting items are still computed; without it they fail
        with :class:`SchedulerClosedError`. Waits up to ``timeout`` seconds for the worker to finish."""
        with self._cond:
            self._closing = True
            # Background items are never drained: their owner (the job runner) keeps them durably and
            # resumes them after a restart.
            for item in self._background if drain else [*self._pending, *self._background]:
                if item.future.set_running_or_notify_cancel():
                    item.future.set_exception(SchedulerClosedError("the server shut down"))
            self._background.clear()
            if not drain:
                self._pending.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        elif thread is None and drain:
            # Never started: nothing will run the waiting items, so fail them rather than hang callers.
            self._fail_pending(SchedulerClosedError("the scheduler was closed before it started"))

    # ---------------------------------------------------------------------------------------- internals

    def _fail_pending(self, exc: BaseException) -> None:
        with self._cond:
            items, self._pending = [*self._pending, *self._background], []
            self._background = []
        for item in items:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(exc)

    def _estimate_wait_locked(self) -> float:
        per_item = self._seconds_per_item or 0.1
        return (len(self._pending) + self._running_items) * per_item

    def _drop_cancelled(self) -> None:
        if any(item.future.cancelled() for item in self._pending):
            self._pending = [item for item in self._pending if not item.future.cancelled()]
        if any(item.future.cancelled() for item in self._background):
            self._background = [item for item in self._background if not item.future.cancelled()]

    def _window_is_full(self) -> bool:
        return (
            len(self._pending) >= self.max_batch_size
            or sum(item.tokens for item in self._pending) >= self.max_batch_tokens
        )

    def _background_may_run(self) -> bool:
        """Background items wait while an interactive request is on its way (and never run while closing)."""
        return bool(self._background) and not self._closing and self._nothing_on_the_way(default=True)

    def _nothing_on_the_way(self, default: bool = False) -> bool:
        if self._arrivals is None:
            return default
        try:
            return self._arrivals() <= 0
        except Exception:  # a broken hint must not stall the worker
            return True

    def _select_locked(self) -> list[_Item[P, R]]:
        """Take the next batch: the oldest interactive item plus compatible followers; with no interactive
        item waiting, a small batch of background items."""
        self._drop_cancelled()
        if self._pending:
            lane, size = self._pending, self.max_batch_size
        elif self._background:
            lane, size = self._background, self.background_batch_size
        else:
            return []
        oldest = lane[0]
        batch = [oldest]
        shortest = longest = max(oldest.tokens, 1)
        if not self.deterministic:
            for item in lane[1:]:
                if len(batch) >= size:
                    break
                length = max(item.tokens, 1)
                new_shortest, new_longest = min(shortest, length), max(longest, length)
                if new_longest > self.length_ratio * new_shortest:
                    continue
                if new_longest * (len(batch) + 1) > self.max_batch_tokens:
                    continue
                batch.append(item)
                shortest, longest = new_shortest, new_longest
        chosen = set(map(id, batch))
        if lane is self._pending:
            self._pending = [item for item in lane if id(item) not in chosen]
        else:
            self._background = [item for item in lane if id(item) not in chosen]
        # A future cancelled between the sweep and now is dropped here; after this call it cannot be.
        return [item for item in batch if item.future.set_running_or_notify_cancel()]

    def _worker(self) -> None:
        if self._on_thread_start is not None:
            try:
                self._on_thread_start()
            except Exception:  # a slower thread is better than no worker: callers would hang forever
                logger.exception("batch worker start hook failed")
        while True:
            with self._cond:
                while not self._pending and not self._closing and not self._background_may_run():
                    # With background work waiting, re-check soon: an arriving interactive request is
                    # counted by ``arrivals`` before it is submitted.
                    self._cond.wait(0.05 if self._background else None)
                if not self._pending and not self._background_may_run():
                    return  # closing and drained
                if self._pending:
                    # Wait for company: until the oldest item has waited window_s, a batch is full, or
                    # nothing more is on its way.
                    deadline = self._pending[0].enqueued_at + self.window_s
                    while not self._closing and not self._window_is_full() and not self._nothing_on_the_way():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        self._cond.wait(remaining)
                batch = self._select_locked()
                self._running_items = len(batch)
            if batch:
                try:
                    self._run(batch)
                except BaseException:  # never let the worker die: callers would hang forever
                    logger.exception("batch worker error")
                    for item in batch:
                        if not item.future.done():
                            item.future.set_exception(RuntimeError("internal scheduler error"))
            with self._cond:
                self._running_items = 0

    def _call(self, items: list[_Item[P, R]]) -> tuple[list[R] | None, BaseException | None, float]:
        started = time.perf_counter()
        try:
            results = list(self._run_batch([item.payload for item in items]))
            if len(results) != len(items):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(items)} items")
            return results, None, time.perf_counter() - started
        except Exception as exc:
            return None, exc, time.perf_counter() - started

    def _observe(self, items: list[_Item[P, R]], seconds: float, failed: bool) -> None:
        longest = max(item.tokens for item in items)
        stats = BatchStats(len(items), longest * len(items), sum(i.tokens for i in items), seconds, failed)
        with self._cond:
            per_item = seconds / len(items)
            self._seconds_per_item = (
                per_item if self._seconds_per_item == 0 else 0.8 * self._seconds_per_item + 0.2 * per_item
            )
        if self._on_batch is not None:
            try:
                self._on_batch(stats)
            except Exception:  # an observer bug must not fail requests
                logger.exception("on_batch observer failed")

    def _run(self, batch: list[_Item[P, R]]) -> None:
        results, error, seconds = self._call(batch)
        self._observe(batch, seconds, failed=error is not None)
        if error is None:
            assert results is not None
            for item, result in zip(batch, results, strict=True):
                item.future.set_result(result)
            return
        if len(batch) == 1:
            batch[0].future.set_exception(error)
            return
        logger.warning("a batch of %d failed (%s); retrying its items one by one", len(batch), error)
        for item in batch:
            one, one_error, one_seconds = self._call([item])
            self._observe([item], one_seconds, failed=one_error is not None)
            if one_error is None:
                assert one is not None
                item.future.set_result(one[0])
            else:
                item.future.set_exception(one_error)
