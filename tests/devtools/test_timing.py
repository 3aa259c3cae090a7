"""`devtools.timing`: every sample kept, the median with its spread."""

from __future__ import annotations

import pytest
from devtools.timing import Samples, percentile, repeat, spread


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_spread_keeps_every_sample_in_order() -> None:
    figures = spread([3.0, 1.0, 2.0, 10.0])
    assert figures == {
        "n": 4,
        "median": 2.5,
        "min": 1.0,
        "max": 10.0,
        "q1": 1.75,
        "q3": 4.75,
        "samples": [3.0, 1.0, 2.0, 10.0],
    }
    with pytest.raises(ValueError):
        spread([])


def test_repeat_times_each_call_after_the_warm_up() -> None:
    calls: list[int] = []
    seconds = repeat(lambda: calls.append(1), 3, warmup=2)
    assert len(calls) == 5 and len(seconds.values) == 3
    assert all(value >= 0 for value in seconds.values)
    assert Samples.of([2.0, 4.0]).map(lambda s: 8 / s).values == (4.0, 2.0)
    with pytest.raises(ValueError):
        repeat(lambda: None, 0)
