"""Repetitions and their spread: every sample is kept, a figure is reported as its median with min / max and
the quartiles, so a reader can see how far one run is from another on a shared machine."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_REPEATS", "Samples", "percentile", "repeat", "spread"]

#: Repetitions of every headline figure unless a smoke run asks for fewer.
DEFAULT_REPEATS = 3


def percentile(values: Sequence[float], fraction: float) -> float:
    """Linear-interpolated percentile (``fraction`` in [0, 1]) of a non-empty sequence.

    Raises ValueError for an empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Samples:
    """The measured values of one figure, in the order they were taken."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> Samples:
        """Samples from any iterable of numbers. Raises ValueError when it is empty."""
        collected = tuple(float(value) for value in values)
        if not collected:
            raise ValueError("a figure needs at least one sample")
        return cls(collected)

    @property
    def median(self) -> float:
        return percentile(self.values, 0.5)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    def map(self, function: Callable[[float], float]) -> Samples:
        """The samples transformed one by one (seconds into a rate, say)."""
        return Samples(tuple(function(value) for value in self.values))

    def summary(self, digits: int = 4) -> dict[str, Any]:
        """``{"n", "median", "min", "max", "q1", "q3", "samples"}``, rounded to ``digits`` decimals."""
        return {
            "n": len(self.values),
            "median": round(self.median, digits),
            "min": round(self.min, digits),
            "max": round(self.max, digits),
            "q1": round(percentile(self.values, 0.25), digits),
            "q3": round(percentile(self.values, 0.75), digits),
            "samples": [round(value, digits) for value in self.values],
        }


def spread(values: Iterable[float], digits: int = 4) -> dict[str, Any]:
    """`Samples.summary` of ``values``. Raises ValueError when there are none."""
    return Samples.of(values).summary(digits)


def repeat(
    call: Callable[[], object],
    repeats: int = DEFAULT_REPEATS,
    *,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> Samples:
    """Wall seconds of ``repeats`` calls of ``call`` after ``warmup`` untimed ones. ``sync`` (e.g. a CUDA
    synchronize) runs before each clock reading. Raises ValueError for ``repeats < 1``."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        call()
    if sync is not None:
        sync()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        if sync is not None:
            sync()
        seconds.append(time.perf_counter() - started)
    return Samples(tuple(seconds))
