"""The engine's blocking figures (replica status, state-cache counters) for ``/ready``, ``/status.json`` and
``/metrics``, asked on a few threads of their own and each within a time limit.

A scale-out engine answers them from the cluster (Ray Serve's controller, Ray's actor list). A cluster that
hangs must not hang the probes with it, nor take the threads the rest of the server shares (anyio's default
pool reads request bodies and runs the jobs store): each query runs on a daemon thread of its own, at most
:data:`QUERY_THREADS` at a time, and its caller waits :data:`QUERY_TIMEOUT_S` at most, for a free thread and
the answer together. A query past its time limit keeps its thread until the cluster answers (a blocked call
cannot be interrupted), so with every thread stuck the next callers wait for one and time out, starting
none: the threads stay bounded. anyio's ``to_thread.run_sync`` with a ``CapacityLimiter`` of its own would
not bound them: a call abandoned on timeout gives its token back while its thread still waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["QUERY_THREADS", "QUERY_TIMEOUT_S", "EngineQueries", "EngineQueryError"]

T = TypeVar("T")

QUERY_THREADS = 4
"""Engine queries running at once (each probe or page poll asks one)."""
QUERY_TIMEOUT_S = 5.0
"""How long a caller waits for an engine query: below the usual probe timeouts, far above a healthy
cluster's answer (milliseconds)."""


class EngineQueryError(Exception):
    """An engine query failed, or did not answer within its time limit; the message says which."""


class EngineQueries:
    """Runs the engine's blocking figure queries off the event loop, bounded in threads and in time."""

    def __init__(self, threads: int = QUERY_THREADS, timeout_s: float = QUERY_TIMEOUT_S) -> None:
        self.threads = threads
        self.timeout_s = timeout_s
        """Seconds a caller waits (an attribute: tests shorten it)."""
        # One per event loop (a server has one): an asyncio semaphore belongs to the loop it first ran on.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    async def ask(self, query: Callable[[], T]) -> T:
        """The result of ``query()``, run on a thread of its own. Raises :class:`EngineQueryError` when it
        raises, or when no thread became free and answered within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.threads))
        answer: asyncio.Future[T] = loop.create_future()
        started = False
        try:
            async with asyncio.timeout(self.timeout_s):
                await slots.acquire()
                thread = threading.Thread(
                    target=_run, args=(query, loop, slots, answer), name="clef-engine-query", daemon=True
                )
                try:
                    thread.start()
                except RuntimeError as exc:  # no thread to be had: the slot was not used
                    slots.release()
                    raise EngineQueryError(f"cannot start an engine query thread: {exc}") from None
                started = True
                # A timeout cancels this future: the thread's answer, when it comes, is dropped.
                return await answer
        except TimeoutError:
            if started:
                raise EngineQueryError(f"the engine did not answer within {self.timeout_s:g} s") from None
            raise EngineQueryError(
                f"no engine query thread came free within {self.timeout_s:g} s (the {self.threads} there are "
                "still wait on earlier queries)"
            ) from None


def _run(
    query: Callable[[], Any],
    loop: asyncio.AbstractEventLoop,
    slots: asyncio.Semaphore,
    answer: asyncio.Future[Any],
) -> None:
    """Run ``query`` on this thread, then hand its outcome to ``answer`` and the thread's slot back, both on
    the event loop."""
    outcome: Any = None
    failure: EngineQueryError | None = None
    try:
        outcome = query()
    except BaseException as exc:  # whatever it is, the slot must come back and the caller hear of it
        # Wrapped here: a TimeoutError of the query's own must not read as the caller's time limit.
        failure = EngineQueryError(f"{type(exc).__name__}: {exc}")
        failure.__cause__ = exc

    def settle() -> None:
        slots.release()
        if answer.done():  # the caller stopped waiting
            return
        if failure is not None:
            answer.set_exception(failure)
        else:
            answer.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the event loop closed while the cluster kept this thread
        loop.call_soon_threadsafe(settle)
