"""The typed decision and the one place its System One body is written."""

from __future__ import annotations

from clef_runtime.engine.decision import CacheReport, Decision, RequestTimings
from clef_runtime.engine.head_records import HeadIdentity

ANSWERS = {"q": {"type": "noul", "noul": 0.25}}


def test_the_body_carries_the_cache_report_and_the_calibration() -> None:
    decision = Decision("m", ANSWERS, 120, CacheReport("partial", 80), calibration="cal@sha256:abc")
    assert decision.body() == {
        "model": "m",
        "answers": ANSWERS,
        "usage": {"input_tokens": 120, "output_tokens": 0, "input_tokens_details": {"cached_tokens": 80}},
        "x_state_cache": "partial",
        "x_calibration": "cal@sha256:abc",
    }


def test_a_deterministic_body_leaves_the_cache_report_out() -> None:
    cold = Decision("m", ANSWERS, 120, CacheReport("miss", 0), timings=RequestTimings(queue_s=0.5))
    hit = Decision("m", ANSWERS, 120, CacheReport("hit", 100), timings=RequestTimings(compute_s=0.1))
    assert cold.body(deterministic=True) == hit.body(deterministic=True)  # identical bytes for identical work
    assert "x_state_cache" not in hit.body(deterministic=True)
    assert hit.body()["usage"]["input_tokens_details"]["cached_tokens"] == 100


def test_timings_and_probabilities_stay_out_of_the_body() -> None:
    decision = Decision("m", ANSWERS, 5, timings=RequestTimings(1, 2, 3, 4), probabilities=[[0.25, 0.75]])
    assert set(decision.body()) == {"model", "answers", "usage", "x_state_cache"}  # no head: no x_head


def test_the_body_names_the_head_that_answered() -> None:
    decision = Decision("jev-latest", ANSWERS, 5, head=HeadIdentity("tiny", "ab" * 32))
    assert decision.body()["x_head"] == {"name": "tiny", "digest": "ab" * 32}
    assert decision.body(deterministic=True)["x_head"] == decision.body()["x_head"]  # a digest is stable
