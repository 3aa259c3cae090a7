"""The engine loop, with a recording fake runner (no model, no HTTP): futures, steps, chunks, cancellation,
failures, lanes, closing, timings."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass

import pytest

from clef_runtime.engine.decision import Decision
from clef_runtime.engine.loop import (
    EngineLoop,
    Estimate,
    QueueFullError,
    QueueTimeoutError,
    SchedulerClosedError,
    StepStats,
)
from clef_runtime.engine.policy import StepSettings
from tests.helpers import ManualClock


@dataclass(frozen=True)
class Item:
    name: str
    tokens: int
    group: str = "g"
    hold: str | None = None


class FakeRunner:
    """Rows of ``tokens`` tokens computed chunk by chunk; logs every admission and advance. ``gate``: every
    advance waits for it (tests decide when the worker moves on); ``fail_on(name)`` makes an advance of a
    batch holding that row raise."""

    def __init__(self, fail_on: Callable[[str], bool] | None = None, held: bool = False) -> None:
        self.log: list[tuple[object, ...]] = []
        self.fail_on = fail_on
        self.entered = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.held = held
        self.lock = threading.Lock()

    def estimate(self, item: Item) -> Estimate:
        if item.name == "unestimable":
            raise ValueError("cannot estimate")
        return Estimate(item.tokens, item.group, item.hold)

    def admit(
        self, items: Sequence[Item], *, share: Collection[Hashable] = (), held: Collection[int] = ()
    ) -> list[FakeBatch]:
        with self.lock:
            self.log.append(("admit", tuple(item.name for item in items)))
        return [FakeBatch(self, dict(enumerate(items)))]

    def advance(self, batch: FakeBatch, tokens: int) -> dict[int, Decision]:
        return batch.advance(tokens)

    def step(self) -> None:
        """Let one held advance go."""
        self.release.release()


class FakeBatch:
    def __init__(self, runner: FakeRunner, items: dict[int, Item]) -> None:
        self.runner = runner
        self.items = items
        self.left = {index: item.tokens for index, item in items.items()}

    def remaining(self) -> dict[int, int]:
        return dict(self.left)

    def advance(self, tokens: int) -> dict[int, Decision]:
        runner = self.runner
        names = tuple(self.items[i].name for i in self.left)
        with runner.lock:
            runner.log.append(("advance", names, tokens))
        runner.entered.release()
        if runner.held:
            assert runner.release.acquire(timeout=10)
        if runner.fail_on and any(runner.fail_on(name) for name in names):
            raise ValueError("bad row in " + ",".join(names))
        done = {}
        for index in list(self.left):
            self.left[index] -= tokens
            if self.left[index] <= 0:
                del self.left[index]
                item = self.items[index]
                done[index] = Decision(model=item.name.upper(), answers={}, input_tokens=item.tokens)
        return done

    def drop(self, indexes: Iterable[int]) -> None:
        for index in indexes:
            self.left.pop(index, None)
        with self.runner.lock:
            self.runner.log.append(("drop", tuple(self.items[i].name for i in indexes)))


def start(runner: FakeRunner, budget: int = 512, **options: object) -> EngineLoop:
    settings = {k: options.pop(k) for k in list(options) if k in StepSettings.__dataclass_fields__}
    loop = EngineLoop(runner, StepSettings(max_step_tokens=budget, **settings), **options)  # type: ignore[arg-type]
    loop.start()
    return loop


def occupy(loop: EngineLoop, runner: FakeRunner, tokens: int = 64) -> Future[Decision]:
    """Submit one request and wait until the worker is computing it (held by the runner)."""
    blocker = loop.submit(Item("blocker", tokens))
    assert runner.entered.acquire(timeout=5)
    return blocker


def drain(runner: FakeRunner, futures: Iterable[Future[Decision]]) -> None:
    """Release held advances until every future is done."""
    pending = list(futures)
    deadline = time.monotonic() + 10
    while any(not f.done() for f in pending):
        assert time.monotonic() < deadline
        runner.step()
        time.sleep(0.001)


def test_each_answer_goes_to_its_own_future() -> None:
    loop = start(FakeRunner())
    futures = {name: loop.submit(Item(name, 30)) for name in ("alpha", "beta", "gamma")}
    assert {name: f.result(5).model for name, f in futures.items()} == {
        "alpha": "ALPHA",
        "beta": "BETA",
        "gamma": "GAMMA",
    }
    loop.close()


def test_requests_waiting_together_are_admitted_as_one_batch() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner)
    blocker = occupy(loop, runner)
    later = [loop.submit(Item(name, 100)) for name in "abcd"]
    drain(runner, [blocker, *later])
    assert ("admit", ("a", "b", "c", "d")) in runner.log
    loop.close()


def test_a_long_request_runs_in_chunks_and_a_short_one_returns_between_them() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, budget=256)
    long = loop.submit(Item("long", 1000))
    assert runner.entered.acquire(timeout=5)  # first chunk of the long request running
    short = loop.submit(Item("short", 50))
    runner.step()  # finish chunk 1
    assert runner.entered.acquire(timeout=5)
    runner.step()
    deadline = time.monotonic() + 5
    while not short.done():
        runner.step()
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not long.done()  # the short request finished while the long one was still being computed
    drain(runner, [long])
    advances = [entry for entry in runner.log if entry[0] == "advance"]
    assert advances[0] == ("advance", ("long",), 256)
    assert ("advance", ("short",), 50) in advances
    assert sum(tokens for _, names, tokens in advances if names == ("long",)) >= 1000
    assert long.result(0).timings.steps >= 4
    loop.close()


def test_timings_say_queue_time_compute_time_and_steps() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, budget=128)
    blocker = occupy(loop, runner)
    waiting = loop.submit(Item("w", 300))
    time.sleep(0.05)
    drain(runner, [blocker, waiting])
    timings = waiting.result(0).timings
    assert timings.queue_s >= 0.04  # it waited behind the blocker's step
    assert timings.steps == 3  # 300 tokens in steps of 128
    assert timings.compute_s > 0
    loop.close()


def test_queue_bound_raises_queue_full_with_a_retry_estimate() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, max_queue=2)
    blocker = occupy(loop, runner)  # running, not queued
    queued = [loop.submit(Item("q1", 10)), loop.submit(Item("q2", 10))]
    with pytest.raises(QueueFullError) as info:
        loop.submit(Item("q3", 10))
    assert info.value.queued == 2 and info.value.retry_after_s > 0
    drain(runner, [blocker, *queued])
    loop.close()


def test_a_cancelled_waiting_request_is_never_computed_and_frees_its_slot() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, max_queue=1)
    blocker = occupy(loop, runner)
    doomed = loop.submit(Item("doomed", 10))
    assert doomed.cancel()
    kept = loop.submit(Item("kept", 10))  # the cancelled request no longer counts against max_queue
    drain(runner, [blocker, kept])
    with pytest.raises(CancelledError):
        doomed.result(0)
    assert all("doomed" not in str(entry) for entry in runner.log)
    loop.close()


def test_a_cancelled_running_request_leaves_its_batch_between_chunks() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, budget=128)
    gone = loop.submit(Item("gone", 1000))
    assert runner.entered.acquire(timeout=5)  # its first chunk is running: work in flight
    assert gone.cancel()  # still cancellable: a request's future stays pending until its answer
    runner.step()
    other = loop.submit(Item("other", 64))
    drain(runner, [other])
    assert ("drop", ("gone",)) in runner.log
    advanced = [entry for entry in runner.log if entry[0] == "advance" and "gone" in entry[1]]
    assert len(advanced) == 1  # no chunk after the cancellation
    assert loop.running == 0
    loop.close()


def test_a_failing_batch_is_retried_request_by_request() -> None:
    runner = FakeRunner(fail_on=lambda name: name == "bad", held=True)
    stats: list[StepStats] = []
    loop = start(runner, on_step=stats.append)
    blocker = occupy(loop, runner)
    good1, bad, good2 = (loop.submit(Item(name, 20)) for name in ("good1", "bad", "good2"))
    drain(runner, [blocker, good1, bad, good2])
    assert good1.result(0).model == "GOOD1" and good2.result(0).model == "GOOD2"
    with pytest.raises(ValueError, match="bad"):
        bad.result(0)
    admits = [entry[1] for entry in runner.log if entry[0] == "admit"]
    assert admits[1:] == [("good1", "bad", "good2"), ("good1",), ("bad",), ("good2",)]
    assert any(s.failed for s in stats)
    loop.close()


def test_a_request_that_cannot_be_estimated_fails_alone() -> None:
    loop = start(FakeRunner())
    bad, good = loop.submit(Item("unestimable", 5)), loop.submit(Item("fine", 5))
    assert good.result(5).model == "FINE"
    with pytest.raises(ValueError, match="estimate"):
        bad.result(5)
    loop.close()


def test_deterministic_mode_runs_each_request_alone_in_arrival_order() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, deterministic=True)
    blocker = occupy(loop, runner)
    futures = [loop.submit(Item(name, n)) for name, n in (("c", 50), ("a", 1), ("b", 50))]
    drain(runner, [blocker, *futures])
    admits = [entry[1] for entry in runner.log if entry[0] == "admit"]
    assert admits == [("blocker",), ("c",), ("a",), ("b",)]
    loop.close()


def test_background_requests_wait_for_interactive_work_and_have_their_own_bound() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, max_background=2, background_rows=1)
    first = loop.submit(Item("bg0", 10), background=True)
    assert runner.entered.acquire(timeout=5)
    later = [loop.submit(Item(f"bg{i}", 10), background=True) for i in (1, 2)]
    with pytest.raises(QueueFullError):
        loop.submit(Item("bg3", 10), background=True)
    interactive = [loop.submit(Item(f"i{i}", 10)) for i in range(2)]  # the interactive bound is apart
    drain(runner, [first, *later, *interactive])
    admits = [entry[1] for entry in runner.log if entry[0] == "admit"]
    assert admits == [("bg0",), ("i0", "i1"), ("bg1",), ("bg2",)]
    loop.close()


def test_close_drains_interactive_requests_fails_background_ones_and_refuses_new_ones() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner)
    blocker = occupy(loop, runner)
    waiting = [loop.submit(Item(f"w{i}", 10)) for i in range(3)]
    job = loop.submit(Item("job", 10), background=True)
    closer = threading.Thread(target=loop.close)
    closer.start()
    deadline = time.monotonic() + 5
    while not loop.closed:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(SchedulerClosedError):
        loop.submit(Item("late", 1))
    drain(runner, [blocker, *waiting])
    closer.join(5)
    assert not closer.is_alive()
    assert [f.result(0).model for f in waiting] == ["W0", "W1", "W2"]
    with pytest.raises(SchedulerClosedError):
        job.result(0)


def test_close_without_drain_fails_what_waits_and_what_runs() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, budget=64)
    running = loop.submit(Item("long", 1000))
    assert runner.entered.acquire(timeout=5)
    waiting = loop.submit(Item("w", 10))
    closer = threading.Thread(target=lambda: loop.close(drain=False, timeout=5))
    closer.start()
    runner.step()
    closer.join(5)
    with pytest.raises(SchedulerClosedError):
        waiting.result(5)
    with pytest.raises(SchedulerClosedError):
        running.result(5)


def test_run_until_idle_runs_the_steps_on_the_calling_thread() -> None:
    runner = FakeRunner()
    loop = EngineLoop(runner, StepSettings(max_step_tokens=100))
    futures = [loop.submit(Item(f"r{i}", 150)) for i in range(3)]
    loop.run_until_idle()
    assert [f.result(0).model for f in futures] == ["R0", "R1", "R2"]
    loop.start()
    with pytest.raises(RuntimeError, match="worker thread"):
        loop.run_until_idle()
    loop.close()


def test_the_thread_start_hook_runs_on_the_worker_before_the_first_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []
    loop = start(
        FakeRunner(),
        name="worker-x",
        on_thread_start=lambda: seen.append(threading.current_thread().name),
    )
    assert loop.submit(Item("a", 1)).result(5).model == "A"
    loop.close()
    assert seen == ["worker-x"]

    def broken() -> None:
        raise RuntimeError("no team")

    failing = start(FakeRunner(), on_thread_start=broken)
    assert failing.submit(Item("b", 1)).result(5).model == "B"
    failing.close()
    assert "engine thread start hook failed" in caplog.text


def test_a_request_that_waits_past_the_queue_timeout_fails_while_a_step_runs_and_is_never_computed() -> None:
    runner = FakeRunner(held=True)
    timeouts: list[QueueTimeoutError] = []
    loop = start(runner, queue_timeout_s=0.05, on_timeout=timeouts.append)
    blocker = occupy(loop, runner)  # the worker is inside a step, held there
    late = loop.submit(Item("late", 10))
    with pytest.raises(QueueTimeoutError) as info:
        late.result(5)  # failed by the timer thread: the worker is still held in the blocker's step
    assert not blocker.done()
    assert info.value.waited_s >= 0.05 and info.value.timeout_s == 0.05 and info.value.retry_after_s > 0
    assert timeouts == [info.value]
    assert loop.queue_depth == 0  # its queue slot is free at once
    drain(runner, [blocker])
    after = loop.submit(Item("after", 10))
    drain(runner, [after])
    admitted = [names for kind, names, *_ in runner.log if kind == "admit"]
    assert admitted == [("blocker",), ("after",)]  # "late" never reached the engine
    loop.close()


def next_advance(runner: FakeRunner, futures: Sequence[Future[Decision]]) -> bool:
    """Wait until the worker enters its next (held) advance: True, or False once every future is done."""
    deadline = time.monotonic() + 10
    while not runner.entered.acquire(timeout=0.01):
        if all(f.done() for f in futures):
            return False
        assert time.monotonic() < deadline
    return True


def test_every_admitted_request_waited_less_than_the_queue_timeout() -> None:
    # Each step takes 0.15 s on the loop's clock, moved by the test while the worker is held inside the
    # step: the queue times do not depend on how fast a loaded machine schedules the threads.
    clock = ManualClock()
    runner = FakeRunner(held=True)
    loop = start(runner, budget=64, queue_timeout_s=0.2, clock=clock)
    blocker = occupy(loop, runner)
    queued = [loop.submit(Item(f"q{i}", 64)) for i in range(6)]
    running = True
    while running:  # one 64-token request per step, each step slow
        clock.now += 0.15
        runner.step()
        running = next_advance(runner, [blocker, *queued])
    answered = [f for f in queued if f.exception() is None]
    expired = [f for f in queued if isinstance(f.exception(), QueueTimeoutError)]
    assert len(answered) + len(expired) == len(queued)
    assert answered and expired  # the slow steps let some start in time and not the others
    assert all(f.result().timings.queue_s < 0.2 for f in answered)
    loop.close()


def test_background_requests_have_no_queue_timeout() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, queue_timeout_s=0.02)
    blocker = occupy(loop, runner)
    job_line = loop.submit(Item("line", 10), background=True)
    time.sleep(0.1)
    assert not job_line.done()
    drain(runner, [blocker, job_line])
    assert job_line.result(0).model == "LINE"
    loop.close()


def test_a_queue_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="queue_timeout_s"):
        EngineLoop(FakeRunner(), StepSettings(max_step_tokens=64), queue_timeout_s=0)


def test_the_wait_before_submission_counts_against_the_queue_timeout() -> None:
    runner = FakeRunner(held=True)
    loop = start(runner, queue_timeout_s=10.0)
    blocker = occupy(loop, runner)
    late = loop.submit(Item("late", 10), waited_s=9.99)  # arrived at the server almost 10 s ago
    with pytest.raises(QueueTimeoutError) as info:
        late.result(5)
    assert info.value.waited_s >= 10.0
    drain(runner, [blocker])
    loop.close()


class TimedBatch(FakeBatch):
    """A `FakeBatch` whose every advance takes ``step_s`` on ``clock``, whatever it holds (a batched step's
    cost is mostly per step, not per token)."""

    def __init__(self, runner: FakeRunner, items: dict[int, Item], clock: ManualClock, step_s: float) -> None:
        super().__init__(runner, items)
        self.clock = clock
        self.step_s = step_s

    def advance(self, tokens: int) -> dict[int, Decision]:
        self.clock.now += self.step_s
        return super().advance(tokens)


class TimedRunner(FakeRunner):
    def __init__(self, clock: ManualClock, step_s: float) -> None:
        super().__init__()
        self.clock = clock
        self.step_s = step_s

    def admit(
        self, items: Sequence[Item], *, share: Collection[Hashable] = (), held: Collection[int] = ()
    ) -> list[FakeBatch]:
        super().admit(items, share=share, held=held)
        return [TimedBatch(self, dict(enumerate(items)), self.clock, self.step_s)]


def test_the_wait_estimate_follows_the_measured_step_time_and_the_steps_ahead() -> None:
    clock = ManualClock()
    runner = TimedRunner(clock, step_s=0.1)
    loop = EngineLoop(runner, StepSettings(max_step_tokens=4096, max_rows=8), clock=clock)
    loop.submit(Item("alone", 100))  # one small request first: the only step measured before the burst
    loop.run_until_idle()
    burst = [loop.submit(Item(f"r{i}", 500)) for i in range(32)]
    estimate = loop.estimated_wait_s()
    before = clock.now
    loop.run_until_idle()
    drained = clock.now - before
    assert all(future.done() for future in burst)
    assert [kind for kind, *_ in runner.log].count("advance") == 5  # the small one, then 32 / 8 rows
    # Within a factor of two of the time the queue took to drain (on the test's clock: no real timing). The
    # old estimate, the small step's cost per token times the work ahead (one step at least), said 4.1 s.
    assert drained / 2 <= estimate <= drained * 2


def test_timings_carry_the_submission_and_each_step_on_the_loops_clock() -> None:
    """What the server's trace spans are placed with: the submission, then one (start, end) per step the
    request took part in, in order, on the loop's clock; the queue and compute times agree with them."""
    clock = ManualClock()
    clock.now = 100.0
    runner = TimedRunner(clock, step_s=0.25)
    loop = EngineLoop(runner, StepSettings(max_step_tokens=128), clock=clock)
    future = loop.submit(Item("long", 300))  # three steps of 128 tokens
    clock.now += 1.0  # waits a second before the loop runs
    loop.run_until_idle()
    timings = future.result(0).timings
    assert timings.submitted_at == 100.0
    assert timings.step_times == ((101.0, 101.25), (101.25, 101.5), (101.5, 101.75))
    assert timings.queue_s == pytest.approx(1.0)
    assert timings.compute_s == pytest.approx(0.75)
