"""The load and soak test (benchmarks/load_test.py) at CI size: mixed requests at concurrency 32 through
the real HTTP stack of a server process with the instant fake engine, a flood against a small queue, and
the 429 latency of a full queue. The full-size runs and their figures are in RELIABILITY.md."""

from __future__ import annotations

import pytest

from benchmarks import load_test


def test_the_workload_is_mixed_and_valid() -> None:
    jobs = load_test.make_jobs(300)
    assert {job.route for job in jobs} == {"/v1/systemone", "/v1/decisions"}
    assert any(job.compress for job in jobs) and not all(job.compress for job in jobs)
    assert len({id(job) for job in jobs}) < len(jobs)  # repeats
    kinds = {
        q["type"] for job in jobs if job.route == "/v1/systemone" for q in job.body["questions"].values()
    }
    assert kinds == {"noul", "choice", "score"}
    assert load_test.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert load_test.percentile(list(map(float, range(1, 101))), 0.99) == 99.0


@pytest.mark.slow
def test_soak_at_ci_size_gets_only_200s_with_each_requests_own_answer_and_stable_memory() -> None:
    report = load_test.run_soak("fake", requests=1000, concurrency=32, warmup=300)
    assert report.failures == [], report
    assert report.statuses == {"200": 1000}
    assert report.wrong_answers == 0 and report.transport_errors == 0
    assert report.rss_growth is not None and report.rss_growth <= load_test.MEMORY_TOLERANCE
    assert report.server_exit_status == 0


@pytest.mark.slow
def test_a_flood_against_a_small_queue_gets_only_200s_and_429s() -> None:
    report = load_test.run_overflow(requests=400, concurrency=32, max_queue=4, delay_s=0.02)
    assert report.failures == [], report
    assert set(report.statuses) == {"200", "429"}
    assert sum(report.statuses.values()) == 400


@pytest.mark.slow
def test_a_full_queue_answers_429_without_waiting_for_the_engine() -> None:
    report = load_test.run_overflow_probe(probes=50)
    assert report.failures == [], report
    # The engine was held (a gate, not a time window) until the last probe: every probe met a full queue and
    # was refused with Retry-After (their latencies are in the report; RELIABILITY.md has the figures).
    assert report.statuses == {"429": 50}
    assert report.p50_429_ms is not None
