"""Prometheus metrics, on a registry of their own (one per app, so tests can build many apps).

Names use the ``clef_`` prefix. Route labels are route templates (``/v1/systemone``) or ``unmatched``, so a
scanner probing random paths cannot blow up the label set.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from clef_runtime.engine.decision import Decision, RequestTimings
from clef_runtime.engine.loop import StepStats
from clef_runtime.server.answer_metrics import AnswerMetrics

__all__ = ["CONTENT_TYPE", "CacheSeries", "RecentRequests", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_STEP_COUNT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)


_CACHE_GAUGES = frozenset({"entries", "points", "bytes", "capacity_bytes"})


CacheSeries = Sequence[tuple[Mapping[str, str], Mapping[str, float]]]
"""The engine's state-cache counters as (labels, counters) pairs: one unlabelled pair for an engine in this
process, one per model replica (labelled ``replica``) for a scale-out engine."""


class _EngineCacheCollector(Collector):
    """Exports the engine's state-cache statistics (``cache_stats() -> {name: n}``, per replica when the
    engine has replicas): sizes (``entries``, ``points``, ``bytes``, ``capacity_bytes``) as gauges
    ``clef_cache_<name>``, everything else (hits, partials, misses, shared, stores, evictions, tokens_saved,
    reused_tokens) as counters ``clef_cache_<name>_total``."""

    def __init__(self, source: Callable[[], CacheSeries]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        try:
            series = list(self._source())
        except Exception:  # a failing engine hook must not break /metrics
            series = []
        label_names = sorted(series[0][0]) if series else []
        for name in sorted({str(name) for _, stats in series for name in stats}):
            safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
            kind = GaugeMetricFamily if safe in _CACHE_GAUGES else CounterMetricFamily
            family = kind(f"clef_cache_{safe}", f"Engine state cache: {name}.", labels=label_names)
            for labels, stats in series:
                if name in stats:
                    family.add_metric([labels[key] for key in label_names], float(stats[name]))
            yield family


class RecentRequests:
    """Exact latency percentiles of the last ``window`` decision requests (the status page's figures), and
    how many were refused as the client's mistake (4xx) or failed on the server (5xx).

    The Prometheus histograms only give bucket bounds (a p50 "between 0.5 and 1 s"); a person reading the
    status page wants the measured figure, so the last few hundred durations are kept as they are. A 4xx
    (bad input, a wrong key, a full queue) says nothing about the server's health: it is counted apart.
    """

    def __init__(self, window: int = 500) -> None:
        self._lock = threading.Lock()
        self._seconds: deque[float] = deque(maxlen=window)
        self.total = 0
        """Decision requests finished since start (any status)."""
        self.rejected = 0
        """Of those, the ones refused with a 4xx (the request was wrong, unauthorised or over a limit)."""
        self.errors = 0
        """Of those, the ones that failed on the server: a 5xx."""

    def add(self, status: int, seconds: float) -> None:
        """Record one finished decision request; only successful ones enter the latency window."""
        with self._lock:
            self.total += 1
            if status >= 500:
                self.errors += 1
            elif status >= 400:
                self.rejected += 1
            else:
                self._seconds.append(seconds)

    def summary(self) -> dict[str, Any]:
        """``{"total", "rejected", "errors", "window", "p50_ms", "p95_ms"}``: counts since start
        (``rejected``: 4xx, ``errors``: 5xx), and the nearest-rank percentiles (milliseconds, None before the
        first success) over the ``window`` latest successes."""
        with self._lock:
            ordered = sorted(self._seconds)
            total, rejected, errors = self.total, self.rejected, self.errors
        return {
            "total": total,
            "rejected": rejected,
            "errors": errors,
            "window": len(ordered),
            "p50_ms": _percentile_ms(ordered, 0.50),
            "p95_ms": _percentile_ms(ordered, 0.95),
        }


def _percentile_ms(ordered: list[float], q: float) -> float | None:
    # Nearest rank: the smallest value with at least q of the values at or below it (always a real sample).
    if not ordered:
        return None
    rank = max(1, math.ceil(q * len(ordered)))
    return round(ordered[rank - 1] * 1000, 1)


class ServerMetrics:
    """All metrics of one server instance."""

    def __init__(self) -> None:
        # The *_created series double the output and no dashboard reads them.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        counter = functools.partial(Counter, registry=self.registry)
        gauge = functools.partial(Gauge, registry=self.registry)
        seconds = functools.partial(Histogram, buckets=_LATENCY_BUCKETS, registry=self.registry)
        tokens = functools.partial(Histogram, buckets=_TOKEN_BUCKETS, registry=self.registry)
        rows = functools.partial(Histogram, buckets=_ROW_BUCKETS, registry=self.registry)
        steps = functools.partial(Histogram, buckets=_STEP_COUNT_BUCKETS, registry=self.registry)
        self.requests = counter(
            "clef_requests", "HTTP requests by route, method and status.", ["route", "method", "status"]
        )
        self.job_lines = counter("clef_job_lines", "Batch-job lines answered (done) or failed.", ["outcome"])
        self.replica_requests = counter(
            "clef_replica_requests",
            "Decisions answered, by the replica that answered them and its state-cache outcome.",
            ["replica", "state_cache"],
        )
        self.latency = seconds(
            "clef_request_duration_seconds", "Time from request arrival to response, by route.", ["route"]
        )
        self.input_tokens = tokens("clef_input_tokens", "Input tokens per answered request.")
        self.truncated = counter(
            "clef_truncated_requests", "Requests whose state was truncated to fit the token limit."
        )
        self.questions = counter("clef_questions", "Questions answered, by type.", ["type"])
        self.step_rows = rows("clef_step_rows", "Requests computed per engine step.")
        self.step_tokens = tokens("clef_step_tokens", "Padded tokens (rows x tokens) per engine step.")
        self.step_seconds = seconds("clef_step_duration_seconds", "Engine time per step.")
        self.step_failures = counter(
            "clef_step_failures", "Engine steps in which a batch raised (its requests are retried alone)."
        )
        self.queue_wait = seconds(
            "clef_queue_wait_seconds", "Time a request waited before its first engine step."
        )
        self.compute_seconds = seconds(
            "clef_compute_seconds", "Time from a request's first engine step to its answer."
        )
        self.request_steps = steps(
            "clef_request_steps",
            "Engine steps a request took part in (a long request is prefilled in chunks across steps).",
        )
        self.queue_depth = gauge("clef_queue_depth", "Requests waiting for the engine.")
        self.running = gauge("clef_running_requests", "Requests being computed now (started, not done).")
        self.inflight = gauge("clef_inflight_requests", "HTTP requests being handled.")
        self.rejected = counter(
            "clef_rejected_requests", "Requests refused before compute, by reason.", ["reason"]
        )
        self.caller_requests = counter(
            "clef_caller_requests",
            "Decision requests by caller (an API key's name, 'anonymous' with auth off; never the key) and "
            "outcome (admitted, rate_limited).",
            ["key", "outcome"],
        )
        self.disconnected = counter(
            "clef_client_disconnects", "Requests whose client went away before the answer."
        )
        self.ready = gauge("clef_model_ready", "1 when the model is loaded and warmed.")
        self.load_seconds = gauge("clef_model_load_seconds", "Seconds spent loading and warming the model.")
        self.recent = RecentRequests()
        """Decision requests (every POST route) for the status page."""
        self.decisions = AnswerMetrics(counter, gauge, functools.partial(Histogram, registry=self.registry))
        """The answers: by model, head, classifier and type, their confidence, near ties, fused kernels."""

    def bind_queue(self, depth: Callable[[], float], running: Callable[[], float]) -> None:
        """Read queue depth and running count from the scheduler at scrape time."""
        self.queue_depth.set_function(depth)
        self.running.set_function(running)

    def bind_engine_cache(self, source: Callable[[], CacheSeries]) -> None:
        """Export the engine's cache counters (if it has any) at scrape time."""
        self.registry.register(_EngineCacheCollector(source))

    def observe_step(self, stats: StepStats) -> None:
        """Record one engine step (the engine loop's ``on_step`` observer)."""
        self.step_rows.observe(stats.rows)
        self.step_tokens.observe(stats.tokens)
        self.step_seconds.observe(stats.seconds)
        if stats.failed:
            self.step_failures.inc()

    def observe_decision(self, timings: RequestTimings) -> None:
        """Record one answered request's queue time, compute time and steps."""
        self.queue_wait.observe(timings.queue_s)
        self.compute_seconds.observe(timings.compute_s)
        self.request_steps.observe(timings.steps)

    def observe_answers(self, decision: Decision, truncated_state_tokens: int, classifier: str = "") -> None:
        """Record one answered request's answers (asked through the saved ``classifier``, "" for none) and
        the state tokens truncation dropped from it."""
        for answer in decision.answers.values():
            self.questions.labels(str(answer.get("type", ""))).inc()
        if truncated_state_tokens:
            self.truncated.inc()
            self.decisions.truncated_tokens.inc(truncated_state_tokens)
        self.decisions.observe(decision, classifier)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        """Record one finished HTTP request."""
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)
        # Every POST route is a decision route; 499 (the client left) is neither a latency nor an error.
        if method == "POST" and route != "unmatched" and status != 499:
            self.recent.add(status, seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
