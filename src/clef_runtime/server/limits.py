"""Per-caller rate limits: one token bucket per caller (an API key's name, or the client's address when auth
is off), refilled at ``rate`` requests per second up to ``burst``.

A request takes one token; with none left it is refused (HTTP 429) and told when the next token comes. The
headers follow the common ``X-RateLimit-*`` convention (GitHub's, and the IETF ``RateLimit`` draft's deltas):
``X-RateLimit-Limit`` is the burst, ``X-RateLimit-Remaining`` the whole tokens left after this request,
``X-RateLimit-Reset`` the seconds until the bucket is full again.

Pure and clock-injected (tests drive the clock). Buckets that have refilled completely are equal to new
ones, so they are dropped when the table grows: the memory is bounded by the callers active within one
refill period, not by every address ever seen.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RateDecision", "RateLimiter"]

_PRUNE_AT = 10_000
"""Buckets kept before full (idle) ones are dropped."""


@dataclass(frozen=True)
class RateDecision:
    """The outcome of one request against its caller's bucket."""

    allowed: bool
    limit: int
    """The burst: requests a caller may make at once."""
    remaining: int
    """Whole tokens left after this request."""
    reset_s: float
    """Seconds until the bucket is full again."""
    retry_after_s: float
    """Seconds until the next token (0 when allowed)."""

    def headers(self) -> dict[str, str]:
        """The ``X-RateLimit-*`` headers (and ``Retry-After``, whole seconds, when refused)."""
        out = {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(self.remaining),
            "X-RateLimit-Reset": str(math.ceil(self.reset_s)),
        }
        if not self.allowed:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """Token buckets by caller (see the module docstring). Thread-safe. Raises ValueError for a rate or a
    burst that is not positive."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not math.isfinite(rate):
            raise ValueError(f"the rate must be a positive number of requests per second, got {rate}")
        if burst < 1:
            raise ValueError(f"the burst must be at least 1, got {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def describe(self) -> str:
        """The limit in words: ``1 request/s (burst 1)``, ``2.5 requests/s (burst 3)``."""
        unit = "request/s" if self.rate == 1 else "requests/s"
        return f"{self.rate:g} {unit} (burst {self.burst})"

    def _refilled(self, bucket: _Bucket, now: float) -> float:
        return min(float(self.burst), bucket.tokens + (now - bucket.updated) * self.rate)

    def take(self, caller: str) -> RateDecision:
        """Take one token from ``caller``'s bucket if it has one."""
        with self._lock:
            now = self._clock()
            bucket = self._buckets.get(caller)
            if bucket is None:
                if len(self._buckets) >= _PRUNE_AT:
                    self._prune(now)
                bucket = self._buckets[caller] = _Bucket(float(self.burst), now)
            tokens = self._refilled(bucket, now)
            allowed = tokens >= 1.0
            if allowed:
                tokens -= 1.0
            bucket.tokens, bucket.updated = tokens, now
        return RateDecision(
            allowed=allowed,
            limit=self.burst,
            remaining=int(tokens),
            reset_s=(self.burst - tokens) / self.rate,
            retry_after_s=0.0 if allowed else (1.0 - tokens) / self.rate,
        )

    def _prune(self, now: float) -> None:
        buckets = self._buckets
        full = [caller for caller, bucket in buckets.items() if self._refilled(bucket, now) >= self.burst]
        for caller in full:
            del self._buckets[caller]

    def __len__(self) -> int:
        """Buckets held."""
        with self._lock:
            return len(self._buckets)
