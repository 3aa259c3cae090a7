"""Open-loop load: requests sent on a fixed schedule whatever the server does, as real traffic arrives, with
what a server under overload must show checked afterwards. The benchmark (``benchmarks/bench_overload.py``)
and the tests (``tests/reliability/test_overload.py``) share it.

A closed-loop client (a fixed number of clients, each waiting for its answer) slows down with the server, so
it can never overload it; here request ``i`` is sent at ``start + i / rate`` on its own connection slot,
answered or not. The run records, per request, its status, its latency, the server's queue time
(``x-queue-time``) and its ``Retry-After``; and the server's resident memory while it runs.

`capacity` measures what the server sustains (closed loop, answers per second); a run at a multiple of it is
an overload of known size. `overload_failures` lists what went wrong: a status other than 200 / 429 / 503,
a refusal without ``Retry-After``, a transport error, an answer that waited past the queue timeout, memory
growth over a tolerance, and (benchmarks only: never a timing assertion in a test) a p99 over a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from devtools.harness import post_all
from devtools.timing import percentile

__all__ = ["OpenLoopRun", "Outcome", "capacity", "overload_failures", "p99_bound_s", "run_open_loop"]

ALLOWED_STATUSES = frozenset({200, 429, 503})
RSS_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Outcome:
    """One request of an open-loop run."""

    scheduled_s: float
    """When it was due, from the start of the run."""
    late_s: float
    """How late the client sent it (a client that cannot keep up is not an open loop)."""
    status: int
    """HTTP status; 0 for a transport error."""
    latency_s: float
    queue_ms: float | None = None
    """The server's ``x-queue-time`` (200 answers)."""
    inference_ms: float | None = None
    """The server's ``x-inference-time``: from its first engine step to its answer (200 answers)."""
    retry_after: str | None = None
    error_type: str | None = None
    """The body's ``detail.error_type`` (errors), or the transport error's class name."""


@dataclass
class OpenLoopRun:
    """What `run_open_loop` measured."""

    rate: float
    duration_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    rss_samples: list[tuple[float, int]] = field(default_factory=list)
    """(seconds from the start, resident bytes) of the server while the run went on."""
    wall_s: float = 0.0

    def statuses(self) -> dict[str, int]:
        """How many requests got each status (``"0"``: transport error)."""
        counts = Counter(str(outcome.status) for outcome in self.outcomes)
        return dict(sorted(counts.items()))

    def summary(self, rss_warm: int | None = None) -> dict[str, Any]:
        """Counts, the 200s' latency and queue-time percentiles, the refusals' reasons and memory."""
        ok = [o for o in self.outcomes if o.status == 200]
        refused = [o for o in self.outcomes if o.status in (429, 503)]
        latencies = [o.latency_s for o in ok]
        queue_ms = [o.queue_ms for o in ok if o.queue_ms is not None]
        inference_ms = [o.inference_ms for o in ok if o.inference_ms is not None]
        out: dict[str, Any] = {
            "rate_per_s": round(self.rate, 3),
            "duration_s": self.duration_s,
            "sent": len(self.outcomes),
            "statuses": self.statuses(),
            "refusal_reasons": dict(sorted(Counter(o.error_type or "?" for o in refused).items())),
            "refusals_with_retry_after": sum(1 for o in refused if o.retry_after),
            "answered_per_s": round(len(ok) / self.wall_s, 3) if self.wall_s else None,
            "max_send_lateness_s": round(max((o.late_s for o in self.outcomes), default=0.0), 4),
        }
        if latencies:
            out["latency_s"] = {
                name: round(percentile(latencies, q), 4)
                for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
            }
            out["latency_s"]["max"] = round(max(latencies), 4)
        if queue_ms:
            out["queue_ms"] = {
                name: round(percentile(queue_ms, q), 1) for name, q in (("p50", 0.5), ("p99", 0.99))
            }
            out["queue_ms"]["max"] = max(queue_ms)
        if inference_ms:
            out["service_ms"] = {
                name: round(percentile(inference_ms, q), 1) for name, q in (("p50", 0.5), ("p99", 0.99))
            }
        if self.rss_samples:
            rss = [value for _, value in self.rss_samples]
            start = rss_warm if rss_warm is not None else rss[0]
            out["rss_mb"] = {
                "warm": round(start / 2**20, 1),
                "peak": round(max(rss) / 2**20, 1),
                "end": round(rss[-1] / 2**20, 1),
            }
            out["rss_growth"] = round(rss[-1] / start - 1, 4)
        return out


def _retry_after(response: httpx.Response) -> str | None:
    return response.headers.get("retry-after")


def _error_type(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    detail = body.get("detail") if isinstance(body, dict) else None
    return detail.get("error_type") if isinstance(detail, dict) else None


async def _send(
    client: httpx.AsyncClient, path: str, body: Mapping[str, Any], due: float, start: float
) -> Outcome:
    delay = start + due - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    late = sent - start - due
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as exc:
        return Outcome(due, late, 0, time.perf_counter() - sent, error_type=type(exc).__name__)
    latency = time.perf_counter() - sent
    if response.status_code == 200:
        queue, inference = response.headers.get("x-queue-time"), response.headers.get("x-inference-time")
        return Outcome(
            due,
            late,
            200,
            latency,
            queue_ms=float(queue) if queue is not None else None,
            inference_ms=float(inference) if inference is not None else None,
        )
    return Outcome(
        due,
        late,
        response.status_code,
        latency,
        retry_after=_retry_after(response),
        error_type=_error_type(response),
    )


async def _sample_rss(
    rss: Callable[[], int], start: float, samples: list[tuple[float, int]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        samples.append((time.perf_counter() - start, rss()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_INTERVAL_S)
    samples.append((time.perf_counter() - start, rss()))


async def _run(
    url: str,
    bodies: Sequence[Mapping[str, Any]],
    rate: float,
    duration_s: float,
    rss: Callable[[], int] | None,
    path: str,
    timeout_s: float,
) -> OpenLoopRun:
    count = max(1, int(rate * duration_s))
    run = OpenLoopRun(rate=rate, duration_s=duration_s)
    # Connections are not a bound here: an open loop sends on time even when every earlier request waits.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_rss(rss, start, run.rss_samples, stop)) if rss else None
        tasks = [
            asyncio.create_task(_send(client, path, bodies[i % len(bodies)], i / rate, start))
            for i in range(count)
        ]
        run.outcomes = list(await asyncio.gather(*tasks))
        run.wall_s = time.perf_counter() - start
        stop.set()
        if sampler is not None:
            await sampler
    return run


def run_open_loop(
    url: str,
    bodies: Sequence[Mapping[str, Any]],
    rate: float,
    duration_s: float,
    *,
    rss: Callable[[], int] | None = None,
    path: str = "/v1/systemone",
    timeout_s: float = 120.0,
) -> OpenLoopRun:
    """Send ``rate * duration_s`` requests (the bodies in turn), request ``i`` at ``i / rate`` seconds, and
    wait for every answer. ``rss()`` (the server's resident bytes) is sampled meanwhile. Bounded: at most
    that many requests, each for at most ``timeout_s``. Raises ValueError for a rate or duration that is
    not positive."""
    if not rate > 0 or not duration_s > 0:
        raise ValueError("an open-loop run needs a positive rate and duration")
    return asyncio.run(_run(url, bodies, rate, duration_s, rss, path, timeout_s))


def capacity(
    url: str, bodies: Sequence[Mapping[str, Any]], concurrency: int, *, path: str = "/v1/systemone"
) -> dict[str, float]:
    """What the server sustains: every body once, closed loop at ``concurrency``. Returns ``{"per_s",
    "service_s", "refused"}``: answers (200) per second, the median latency at that concurrency, and how many
    were not answered 200 (a server with a queue timeout may refuse a few even here, on a busy machine).
    Raises RuntimeError when none was answered."""
    load = post_all(url, bodies, concurrency, path=path)
    answered = len(bodies) - load.errors
    if not answered:
        raise RuntimeError(f"none of {len(bodies)} capacity requests was answered 200")
    return {
        "per_s": answered / load.seconds,
        "service_s": percentile(load.latencies_s, 0.5),
        "refused": float(load.errors),
    }


def overload_failures(
    run: OpenLoopRun,
    *,
    queue_timeout_ms: float | None,
    rss_warm: int | None = None,
    rss_tolerance: float | None = None,
    check_p99: bool = False,
) -> list[str]:
    """What the run shows went wrong under overload (empty: it held). ``check_p99`` (benchmarks only: a
    timing) bounds the answers' p99 latency by the queue timeout plus the p99 of their service time in the
    same run (``x-inference-time``): with the wait before the first step capped at the queue timeout, the
    p99 of wait + service cannot exceed it but for the HTTP round trip itself."""
    failures = []
    statuses = Counter(outcome.status for outcome in run.outcomes)
    other = {status: n for status, n in statuses.items() if status not in ALLOWED_STATUSES}
    if other:
        failures.append(f"statuses other than 200/429/503: {dict(sorted(other.items()))}")
    bare = [o for o in run.outcomes if o.status in (429, 503) and not o.retry_after]
    if bare:
        failures.append(f"{len(bare)} refusals without Retry-After")
    if not statuses.get(200):
        failures.append("no request was answered")
    if queue_timeout_ms is not None:
        waited = [
            o.queue_ms for o in run.outcomes if o.queue_ms is not None and o.queue_ms > queue_timeout_ms
        ]
        if waited:
            failures.append(f"{len(waited)} answers waited past the queue timeout (up to {max(waited)} ms)")
    summary = run.summary(rss_warm)
    if rss_tolerance is not None and summary.get("rss_growth", 0.0) > rss_tolerance:
        failures.append(f"resident memory grew {summary['rss_growth']:.1%} (tolerance {rss_tolerance:.0%})")
    bound = p99_bound_s(summary, queue_timeout_ms)
    if check_p99 and bound is not None and summary["latency_s"]["p99"] > bound:
        failures.append(f"p99 of the answers {summary['latency_s']['p99']} s over the bound {bound:.3f} s")
    return failures


def p99_bound_s(summary: dict[str, Any], queue_timeout_ms: float | None) -> float | None:
    """The queue timeout plus the p99 service time of a run's `OpenLoopRun.summary` (None without either)."""
    if queue_timeout_ms is None or "service_ms" not in summary or "latency_s" not in summary:
        return None
    return round((queue_timeout_ms + summary["service_ms"]["p99"]) / 1000, 4)


def as_dict(run: OpenLoopRun) -> dict[str, Any]:
    """The whole run (every outcome) as JSON-ready data."""
    return dataclasses.asdict(run)
