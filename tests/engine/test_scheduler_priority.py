"""The batcher's background lane (batch-job lines): interactive items always go first."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from clef_runtime.engine.scheduler import DynamicBatcher, QueueFullError, SchedulerClosedError


class HeldRecorder:
    """Records batches; every call waits for ``release`` (so tests decide when the worker moves on)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def __call__(self, payloads: list[str]) -> list[str]:
        self.batches.append(list(payloads))
        self.started.release()
        assert self.release.acquire(timeout=10)
        return [p.upper() for p in payloads]

    def step(self) -> None:
        """Let the call in progress finish, and wait until the next one has started."""
        self.release.release()


def start(recorder: HeldRecorder, **options: object) -> DynamicBatcher[str, str]:
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.0, **options)  # type: ignore[arg-type]
    batcher.start()
    return batcher


def test_interactive_items_run_before_waiting_background_items() -> None:
    recorder = HeldRecorder()
    batcher = start(recorder, background_batch_size=2)
    first = batcher.submit("bg0", 5, background=True)
    assert recorder.started.acquire(timeout=5)  # the worker is busy with bg0
    later_bg = [batcher.submit(f"bg{i}", 5, background=True) for i in range(1, 5)]
    interactive = [batcher.submit(f"i{i}", 5) for i in range(3)]
    for _ in range(4):
        recorder.step()
    for future in [first, *later_bg, *interactive]:
        future.result(5)
    # After the background batch already running: every interactive item, then background in small batches.
    assert recorder.batches == [["bg0"], ["i0", "i1", "i2"], ["bg1", "bg2"], ["bg3", "bg4"]]
    batcher.close()


def test_background_items_are_never_mixed_into_an_interactive_batch() -> None:
    recorder = HeldRecorder()
    batcher = start(recorder, background_batch_size=8)
    blocker = batcher.submit("blocker", 5)
    assert recorder.started.acquire(timeout=5)
    futures = [batcher.submit("bg", 5, background=True), batcher.submit("i", 5)]
    recorder.step()
    recorder.step()
    recorder.step()
    for future in [blocker, *futures]:
        future.result(5)
    assert recorder.batches == [["blocker"], ["i"], ["bg"]]
    batcher.close()


def test_background_waits_while_an_interactive_request_is_on_its_way() -> None:
    recorder = HeldRecorder()
    arriving = [1]
    batcher: DynamicBatcher[str, str] = DynamicBatcher(recorder, window_s=0.0, arrivals=lambda: arriving[0])
    batcher.start()
    background = batcher.submit("bg", 5, background=True)
    # Nothing may start while the interactive request is still being read and encoded.
    assert not recorder.started.acquire(timeout=0.3)
    interactive = batcher.submit("i", 5)
    arriving[0] = 0
    batcher.wake()
    assert recorder.started.acquire(timeout=5)
    recorder.step()
    recorder.step()
    assert interactive.result(5) == "I" and background.result(5) == "BG"
    assert recorder.batches == [["i"], ["bg"]]
    batcher.close()


def test_the_background_lane_has_its_own_bound() -> None:
    recorder = HeldRecorder()
    batcher = start(recorder, max_queue=1, max_background=2)
    blocker = batcher.submit("blocker", 1)
    assert recorder.started.acquire(timeout=5)
    batcher.submit("b1", 1, background=True)
    batcher.submit("b2", 1, background=True)
    with pytest.raises(QueueFullError):
        batcher.submit("b3", 1, background=True)
    waiting = batcher.submit("i1", 1)  # the interactive queue is not taken by background items
    with pytest.raises(QueueFullError):
        batcher.submit("i2", 1)
    for _ in range(3):
        recorder.step()
    assert blocker.result(5) == "BLOCKER" and waiting.result(5) == "I1"
    batcher.close()


def test_closing_fails_waiting_background_items_but_drains_interactive_ones() -> None:
    recorder = HeldRecorder()
    batcher = start(recorder)
    blocker = batcher.submit("blocker", 1)
    assert recorder.started.acquire(timeout=5)
    background: Future[str] = batcher.submit("bg", 1, background=True)
    interactive = batcher.submit("i", 1)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    with pytest.raises(SchedulerClosedError):
        background.result(5)
    recorder.step()
    recorder.step()
    closer.join(5)
    assert blocker.result(5) == "BLOCKER" and interactive.result(5) == "I"
    assert ["bg"] not in recorder.batches
