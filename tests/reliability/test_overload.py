"""Open-loop overload of ``clef serve --model tiny`` (a real server process on loopback): requests arrive on a
fixed schedule at 2.5 times the capacity measured in the same test, whatever the server does.

What must hold (devtools/open_loop.py checks it): only 200 / 429 / 503, every refusal with
Retry-After, no transport error, no answer that waited past the queue timeout (the server's own queue
time), resident memory within 25% of its level after warm-up. The overload is real: requests were shed.
Latency percentiles are figures, reported by benchmarks/bench_overload.py, not asserted here.
"""

from __future__ import annotations

import math

import pytest
from devtools.harness import post_all, start_clef_server
from devtools.open_loop import capacity, overload_failures, run_open_loop
from devtools.requests import generated_requests

pytestmark = pytest.mark.slow

QUEUE_TIMEOUT_MS = 500
OVERLOAD = 2.5
DURATION_S = 20.0


def test_an_open_loop_overload_is_shed_with_503s_and_answers_never_wait_past_the_queue_timeout() -> None:
    server = start_clef_server("tiny", queue_timeout_ms=QUEUE_TIMEOUT_MS, log_level="warning")
    try:
        post_all(server.url, generated_requests(8, seed=0), 1)  # warm-up
        measured = capacity(server.url, generated_requests(48, seed=1), concurrency=4)
        warm = server.rss_bytes()
        run = run_open_loop(
            server.url,
            generated_requests(300, seed=2),
            OVERLOAD * measured["per_s"],
            DURATION_S,
            rss=server.rss_bytes,
        )
        summary = run.summary(warm)
        failures = overload_failures(
            run, queue_timeout_ms=QUEUE_TIMEOUT_MS, rss_warm=warm, rss_tolerance=0.25
        )
        assert failures == [], (failures, summary)
        assert summary["statuses"].get("503", 0) > 0, summary  # the overload happened: work was shed
        assert set(summary["refusal_reasons"]) <= {"queue_timeout", "queue_full"}, summary
        assert server.process.poll() is None  # and the server is still up
    finally:
        assert server.stop() == 0


def test_a_rate_limited_caller_is_held_to_its_bucket_under_an_open_loop() -> None:
    rate, burst = 5.0, 10
    server = start_clef_server("tiny", rate_limit=rate, rate_burst=burst, log_level="warning")
    try:
        run = run_open_loop(server.url, generated_requests(100, seed=3), 25.0, 6.0)
        summary = run.summary()
        assert overload_failures(run, queue_timeout_ms=None) == [], summary
        admitted = summary["statuses"].get("200", 0)
        refused = [o for o in run.outcomes if o.status == 429]
        assert refused and all(o.error_type == "rate_limited" for o in refused), summary
        # A token bucket admits at most its burst plus its rate times the time that passed (the client's
        # wall time includes the server's): a count, not a timing.
        assert burst <= admitted <= burst + math.ceil(rate * run.wall_s) + 1, (admitted, run.wall_s)
    finally:
        assert server.stop() == 0
