"""The open-loop library's bookkeeping and checks, on made-up outcomes (the live runs are in
tests/reliability/test_overload.py): a check that cannot fail would make the overload test pass vacuously."""

from __future__ import annotations

import pytest
from devtools.open_loop import OpenLoopRun, Outcome, overload_failures, p99_bound_s, run_open_loop


def run_of(*outcomes: Outcome, rss: tuple[int, ...] = (100, 100)) -> OpenLoopRun:
    run = OpenLoopRun(rate=10.0, duration_s=1.0, outcomes=list(outcomes), wall_s=1.0)
    run.rss_samples = [(float(i), value) for i, value in enumerate(rss)]
    return run


def ok(latency: float = 0.1, queue_ms: float = 10.0, inference_ms: float = 50.0) -> Outcome:
    return Outcome(0.0, 0.0, 200, latency, queue_ms=queue_ms, inference_ms=inference_ms)


def refused(status: int = 503, retry_after: str | None = "1", error_type: str = "queue_timeout") -> Outcome:
    return Outcome(0.0, 0.0, status, 0.01, retry_after=retry_after, error_type=error_type)


def test_a_run_that_held_has_no_failures() -> None:
    run = run_of(ok(), ok(), refused(), refused(429, error_type="queue_full"))
    assert overload_failures(run, queue_timeout_ms=500, rss_tolerance=0.25, check_p99=True) == []
    summary = run.summary()
    assert summary["statuses"] == {"200": 2, "429": 1, "503": 1}
    assert summary["refusal_reasons"] == {"queue_full": 1, "queue_timeout": 1}
    assert summary["refusals_with_retry_after"] == 2


@pytest.mark.parametrize(
    ("outcomes", "rss", "expected"),
    [
        ((ok(), Outcome(0.0, 0.0, 500, 0.1)), (100, 100), "statuses other than 200/429/503: {500: 1}"),
        ((ok(), Outcome(0.0, 0.0, 0, 0.1, error_type="ReadTimeout")), (100, 100), "{0: 1}"),
        ((ok(), refused(retry_after=None)), (100, 100), "1 refusals without Retry-After"),
        ((refused(),), (100, 100), "no request was answered"),
        ((ok(queue_ms=501.0),), (100, 100), "1 answers waited past the queue timeout"),
        ((ok(),), (100, 130), "resident memory grew 30.0%"),
        ((ok(latency=0.7, inference_ms=100.0),), (100, 100), "over the bound 0.600 s"),
    ],
)
def test_each_way_an_overload_can_go_wrong_is_reported(
    outcomes: tuple[Outcome, ...], rss: tuple[int, ...], expected: str
) -> None:
    failures = overload_failures(
        run_of(*outcomes, rss=rss), queue_timeout_ms=500, rss_tolerance=0.25, check_p99=True
    )
    assert any(expected in failure for failure in failures), failures


def test_the_p99_bound_is_the_queue_timeout_plus_the_runs_own_p99_service_time() -> None:
    summary = run_of(*[ok(inference_ms=float(ms)) for ms in range(1, 101)]).summary()
    assert p99_bound_s(summary, 500) == pytest.approx(0.5 + 0.09901, abs=1e-4)
    assert p99_bound_s(summary, None) is None


def test_a_run_needs_a_positive_rate_and_duration() -> None:
    with pytest.raises(ValueError):
        run_open_loop("http://127.0.0.1:9", [{}], 0.0, 1.0)
