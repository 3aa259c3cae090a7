"""The heap trimmer: at most one trim per interval of engine steps, never a failed step over it, and the C
library's ``malloc_trim`` found where there is one."""

from __future__ import annotations

import platform

import pytest

from clef_runtime.heap_trim import HeapTrimmer, libc_malloc_trim
from tests.helpers import ManualClock


def test_it_trims_at_most_once_per_interval() -> None:
    clock, calls = ManualClock(), []
    trimmer = HeapTrimmer(2.0, trim=lambda: calls.append(clock.now), clock=clock)
    for now in (0.5, 1.9, 2.0, 2.5, 3.9, 4.1, 10.0):
        clock.now = now
        trimmer.after_step()
    assert calls == [2.0, 4.1, 10.0] and trimmer.trims == 3


def test_a_failing_trim_turns_it_off_and_the_step_goes_on() -> None:
    clock = ManualClock()

    def broken() -> None:
        raise OSError("no")

    trimmer = HeapTrimmer(1.0, trim=broken, clock=clock)
    clock.now = 5.0
    assert trimmer.after_step() is False and not trimmer.enabled
    clock.now = 10.0
    assert trimmer.after_step() is False


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        HeapTrimmer(0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_has_malloc_trim_and_it_runs() -> None:
    trim = libc_malloc_trim()
    assert trim is not None and trim() in (0, 1)  # 1: memory was released, 0: there was none to release
