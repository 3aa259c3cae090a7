"""The dynamic batcher, with a recording batch function (no model, no HTTP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future

import pytest

from clef_runtime.engine.scheduler import BatchStats, DynamicBatcher, QueueFullError, SchedulerClosedError


class Recorder:
    """A batch function that records its batches; ``gate`` (when set) holds the first call until released."""

    def __init__(self, fail_on: Callable[[str], bool] | None = None, hold_first: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.fail_on = fail_on
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def __call__(self, payloads: list[str]) -> list[str]:
        self.batches.append(list(payloads))
        self.started.set()
        self.release.wait(10)
        if self.fail_on and any(self.fail_on(p) for p in payloads):
            raise ValueError("bad payload in batch: " + ",".join(p for p in payloads if self.fail_on(p)))
        return [p.upper() for p in payloads]


def occupy(batcher: DynamicBatcher[str, str], recorder: Recorder) -> Future[str]:
    """Submit one item and wait until the worker is busy computing it (held by the recorder's gate)."""
    blocker = batcher.submit("blocker", 1)
    assert recorder.started.wait(5)
    return blocker


def test_results_go_to_their_own_futures() -> None:
    recorder = Recorder()
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.05)
    batcher.start()
    futures = {word: batcher.submit(word, 3) for word in ("alpha", "beta", "gamma")}
    assert {word: f.result(5) for word, f in futures.items()} == {
        "alpha": "ALPHA",
        "beta": "BETA",
        "gamma": "GAMMA",
    }
    batcher.close()


def test_items_waiting_together_share_a_batch_oldest_first() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.0)
    batcher.start()
    blocker = occupy(batcher, recorder)
    later = [batcher.submit(name, 10) for name in ("a", "b", "c", "d")]
    recorder.release.set()
    assert blocker.result(5) == "BLOCKER"
    assert [f.result(5) for f in later] == ["A", "B", "C", "D"]
    assert recorder.batches == [["blocker"], ["a", "b", "c", "d"]]
    batcher.close()


def test_padded_token_budget_limits_a_batch() -> None:
    recorder = Recorder(hold_first=True)
    # budget 30: three items of 10 tokens fit (30), a fourth would pad to 40.
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, max_batch_tokens=30, window_s=0.0)
    batcher.start()
    occupy(batcher, recorder)
    futures = [batcher.submit(f"x{i}", 10) for i in range(5)]
    recorder.release.set()
    for f in futures:
        f.result(5)
    assert recorder.batches[1:] == [["x0", "x1", "x2"], ["x3", "x4"]]
    batcher.close()


def test_budget_counts_the_longest_item_times_the_batch_size() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(
        recorder, max_batch_tokens=40, window_s=0.0, length_ratio=4.0
    )
    batcher.start()
    occupy(batcher, recorder)
    # 20 + 11: padded 2 x 20 = 40 fits; adding a third (12) would pad to 60.
    futures = [batcher.submit("long", 20), batcher.submit("mid", 11), batcher.submit("short", 12)]
    recorder.release.set()
    for f in futures:
        f.result(5)
    assert recorder.batches[1:] == [["long", "mid"], ["short"]]
    batcher.close()


def test_length_ratio_groups_similar_lengths_without_starving_the_oldest() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(
        recorder, max_batch_tokens=10_000, window_s=0.0, length_ratio=2.0
    )
    batcher.start()
    occupy(batcher, recorder)
    lengths = {"s1": 10, "L1": 100, "s2": 12, "L2": 150, "s3": 19}
    futures = [batcher.submit(name, n) for name, n in lengths.items()]
    recorder.release.set()
    for f in futures:
        f.result(5)
    # The oldest (s1) leads and takes the short ones; the long ones follow together.
    assert recorder.batches[1:] == [["s1", "s2", "s3"], ["L1", "L2"]]
    batcher.close()


def test_an_item_over_the_budget_runs_alone() -> None:
    recorder = Recorder()
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, max_batch_tokens=16, window_s=0.0)
    batcher.start()
    assert batcher.submit("huge", 1000).result(5) == "HUGE"
    assert recorder.batches == [["huge"]]
    batcher.close()


def test_max_batch_size_caps_a_batch() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, max_batch_size=2, window_s=0.0)
    batcher.start()
    occupy(batcher, recorder)
    futures = [batcher.submit(f"i{i}", 1) for i in range(5)]
    recorder.release.set()
    for f in futures:
        f.result(5)
    assert [len(b) for b in recorder.batches[1:]] == [2, 2, 1]
    batcher.close()


def test_queue_bound_raises_queue_full_with_a_retry_estimate() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, max_queue=2, window_s=0.0)
    batcher.start()
    occupy(batcher, recorder)  # running, not queued
    batcher.submit("q1", 1)
    batcher.submit("q2", 1)
    with pytest.raises(QueueFullError) as info:
        batcher.submit("q3", 1)
    assert info.value.queued == 2
    assert info.value.retry_after_s > 0
    recorder.release.set()
    batcher.close()


def test_cancelled_item_is_dropped_before_compute_and_frees_its_queue_slot() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, max_queue=1, window_s=0.0)
    batcher.start()
    occupy(batcher, recorder)
    doomed = batcher.submit("doomed", 1)
    assert doomed.cancel()
    kept = batcher.submit("kept", 1)  # the cancelled item no longer counts against max_queue
    recorder.release.set()
    assert kept.result(5) == "KEPT"
    with pytest.raises(CancelledError):
        doomed.result(0)
    assert all("doomed" not in batch for batch in recorder.batches)
    batcher.close()


def test_a_failing_batch_is_retried_item_by_item() -> None:
    recorder = Recorder(fail_on=lambda p: p == "bad", hold_first=True)
    stats: list[BatchStats] = []
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.0, on_batch=stats.append)
    batcher.start()
    occupy(batcher, recorder)
    good1, bad, good2 = (batcher.submit(p, 1) for p in ("good1", "bad", "good2"))
    recorder.release.set()
    assert good1.result(5) == "GOOD1"
    assert good2.result(5) == "GOOD2"
    with pytest.raises(ValueError, match="bad"):
        bad.result(5)
    assert recorder.batches[1:] == [["good1", "bad", "good2"], ["good1"], ["bad"], ["good2"]]
    assert [s.failed for s in stats[1:]] == [True, False, True, False]
    batcher.close()


def test_wrong_result_count_fails_the_items_instead_of_hanging() -> None:
    batcher: DynamicBatcher[str, str] = DynamicBatcher(lambda payloads: [], window_s=0.0)
    batcher.start()
    with pytest.raises(RuntimeError, match="0 results for 1"):
        batcher.submit("x", 1).result(5)
    batcher.close()


def test_deterministic_mode_runs_each_item_alone_in_arrival_order() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=1.0, deterministic=True)
    batcher.start()
    occupy(batcher, recorder)
    futures = [batcher.submit(name, n) for name, n in (("c", 50), ("a", 1), ("b", 50))]
    recorder.release.set()
    for f in futures:
        f.result(5)
    assert recorder.batches == [["blocker"], ["c"], ["a"], ["b"]]
    batcher.close()


def test_collection_window_gathers_items_arriving_shortly_after() -> None:
    # A window far longer than any test machine's pause between two submits: the first item waits for
    # company, and the batch leaves when it is full (not when the window ends), so nothing depends on time.
    recorder = Recorder()
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=600.0, max_batch_size=2)
    batcher.start()
    first = batcher.submit("first", 1)
    assert not recorder.started.wait(0.05)  # held by the window, not run alone
    second = batcher.submit("second", 1)
    assert (first.result(5), second.result(5)) == ("FIRST", "SECOND")
    assert recorder.batches == [["first", "second"]]
    batcher.close()


def test_close_drains_accepted_items_then_refuses_new_ones() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.0)
    batcher.start()
    blocker = occupy(batcher, recorder)
    waiting = [batcher.submit(f"w{i}", 1) for i in range(3)]
    closer = threading.Thread(target=batcher.close)
    closer.start()
    deadline = time.monotonic() + 5
    while not batcher.closed and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(SchedulerClosedError):
        batcher.submit("late", 1)
    recorder.release.set()
    closer.join(5)
    assert not closer.is_alive()
    assert blocker.result(0) == "BLOCKER"
    assert [f.result(0) for f in waiting] == ["W0", "W1", "W2"]


def test_close_without_drain_fails_waiting_items() -> None:
    recorder = Recorder(hold_first=True)
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.0)
    batcher.start()
    occupy(batcher, recorder)
    waiting = batcher.submit("w", 1)
    batcher.close(drain=False, timeout=0)
    with pytest.raises(SchedulerClosedError):
        waiting.result(5)
    recorder.release.set()


def test_observer_sees_size_and_padded_tokens() -> None:
    recorder = Recorder(hold_first=True)
    stats: list[BatchStats] = []
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.0, on_batch=stats.append)
    batcher.start()
    occupy(batcher, recorder)
    futures = [batcher.submit("a", 7), batcher.submit("b", 5)]
    recorder.release.set()
    for f in futures:
        f.result(5)
    batcher.close()
    assert (stats[1].size, stats[1].padded_tokens, stats[1].real_tokens) == (2, 14, 12)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_queue": 0},
        {"max_batch_tokens": 0},
        {"max_batch_size": 0},
        {"window_s": -1},
        {"length_ratio": 0.5},
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DynamicBatcher(lambda payloads: payloads, **kwargs)  # type: ignore[arg-type]


def test_a_lone_item_skips_the_window_when_nothing_else_is_on_its_way() -> None:
    recorder = Recorder()
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=60.0, arrivals=lambda: 0)
    batcher.start()
    assert batcher.submit("alone", 1).result(5) == "ALONE"  # not after a 60 s window
    batcher.close()


def test_the_window_is_held_while_items_are_on_their_way() -> None:
    recorder = Recorder()
    on_the_way = [2]
    batcher: DynamicBatcher[str, str] = DynamicBatcher(
        recorder, window_s=60.0, arrivals=lambda: on_the_way[0]
    )
    batcher.start()
    first = batcher.submit("first", 1)
    on_the_way[0] = 1
    second = batcher.submit("second", 1)
    on_the_way[0] = 0
    batcher.wake()
    assert (first.result(5), second.result(5)) == ("FIRST", "SECOND")
    assert recorder.batches == [["first", "second"]]
    batcher.close()


def test_the_thread_start_hook_runs_on_the_worker_before_the_first_batch() -> None:
    seen: list[str] = []

    def record_calls(payloads: list[str]) -> list[str]:
        seen.append(f"batch on {threading.current_thread().name}")
        return payloads

    batcher: DynamicBatcher[str, str] = DynamicBatcher(
        record_calls,
        window_s=0,
        name="worker-x",
        on_thread_start=lambda: seen.append(f"start on {threading.current_thread().name}"),
    )
    batcher.start()
    try:
        assert batcher.submit("a", 1).result(5) == "a"
    finally:
        batcher.close()
    assert seen == ["start on worker-x", "batch on worker-x"]


def test_a_failing_thread_start_hook_is_logged_and_the_worker_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> None:
        raise RuntimeError("no team")

    batcher: DynamicBatcher[str, str] = DynamicBatcher(Recorder(), window_s=0, on_thread_start=broken)
    batcher.start()
    try:
        assert batcher.submit("a", 1).result(5) == "A"
    finally:
        batcher.close()
    assert "batch worker start hook failed" in caplog.text
