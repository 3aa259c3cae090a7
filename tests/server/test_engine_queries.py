"""`clef_runtime.server.engine_queries`: blocking engine figures on a few threads of their own, each within
a time limit; more callers than threads wait their turn instead of failing. The routes that use it:
``tests/server/test_replicated_engine.py``."""

from __future__ import annotations

import asyncio
import threading

import pytest

from clef_runtime.server.engine_queries import EngineQueries, EngineQueryError


def test_more_callers_than_threads_all_get_their_answer() -> None:
    queries = EngineQueries(threads=2)
    running = 0
    most = 0
    lock = threading.Lock()
    release = threading.Barrier(2)

    def query(value: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(5)  # two at a time reach this: both threads are busy at once
        with lock:
            running -= 1
        return value

    async def main() -> list[int]:
        return await asyncio.gather(*(queries.ask(lambda v=v: query(v)) for v in range(8)))

    assert asyncio.run(main()) == list(range(8))
    assert most == 2


def test_a_failing_query_is_named_and_its_own_timeout_is_not_the_time_limit() -> None:
    queries = EngineQueries()

    def lost() -> None:
        raise KeyError("clef")

    def slow_cluster() -> None:
        raise TimeoutError("the controller took too long")

    async def ask(query: object) -> str:
        with pytest.raises(EngineQueryError) as raised:
            await queries.ask(query)  # type: ignore[arg-type]
        return str(raised.value)

    assert asyncio.run(ask(lost)) == "KeyError: 'clef'"
    assert asyncio.run(ask(slow_cluster)) == "TimeoutError: the controller took too long"


def test_a_query_past_the_time_limit_is_left_behind() -> None:
    queries = EngineQueries(threads=1, timeout_s=0.05)
    release = threading.Event()

    async def main() -> tuple[str, str]:
        with pytest.raises(EngineQueryError) as first:
            await queries.ask(release.wait)
        # Its thread still waits: the next caller finds none free.
        with pytest.raises(EngineQueryError) as second:
            await queries.ask(lambda: None)
        return str(first.value), str(second.value)

    try:
        first, second = asyncio.run(main())
    finally:
        release.set()
    assert first == "the engine did not answer within 0.05 s"
    assert second == (
        "no engine query thread came free within 0.05 s (the 1 there are still wait on earlier queries)"
    )
