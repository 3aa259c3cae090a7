"""Independent questions (``x_independent``): each question answered as if it were asked alone, equal to
separate single-question requests, different from the joint answer, at the cost of one state prefill plus
one schema pass per question."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from clef_runtime import Clef
from clef_runtime.engine.decision import CacheReport, Decision, RequestTimings
from clef_runtime.engine.independent import IndependentRequest, merge_decisions, submit_parts
from clef_runtime.engine.preparer import PreparedRequest
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.systemone import parse_request

QUESTIONS: dict[str, Any] = {
    "billing": {"type": "noul", "instructions": "is this about billing?"},
    "team": {"type": "choice", "criteria": {"pay": "payments", "eng": "engineering", "ops": None}},
    "urgency": {"type": "score", "criteria": ["low", "mid", "high", "critical"]},
}


def body(state: str, **extra: Any) -> dict[str, Any]:
    return {"state": state, "questions": QUESTIONS, **extra}


def single(state: str, question_id: str) -> dict[str, Any]:
    return {"state": state, "questions": {question_id: QUESTIONS[question_id]}}


def gap(one: list[float], other: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(one, other, strict=True))


@pytest.fixture(scope="module")
def clef() -> Clef:
    return Clef.load("tiny", dtype="fp32")


def test_independent_answers_equal_single_question_requests_and_differ_from_joint(clef: Clef) -> None:
    state = "the invoice was charged twice; the customer asks for a refund before friday " * 4
    prepared = clef.prepare(body(state, x_independent=True))
    assert isinstance(prepared, IndependentRequest)
    assert [list(part.request.questions) for part in prepared.parts] == [[q] for q in QUESTIONS]
    (independent,) = clef.probabilities_encoded([prepared])
    clef.clear_cache()
    alone = [clef.probabilities_encoded([clef.prepare(single(state, q))])[0][0] for q in QUESTIONS]
    (joint,) = clef.probabilities_encoded([clef.prepare(body(state))])
    for got, want in zip(independent, alone, strict=True):
        assert gap(got, want) <= 1e-4
    # Joint decoding lets the questions attend to each other: some answer moves.
    assert max(gap(i, j) for i, j in zip(independent, joint, strict=True)) > 1e-3


def test_an_independent_request_costs_one_state_prefill_plus_one_schema_per_question(clef: Clef) -> None:
    state = "a fresh state nobody asked about: the deploy failed on three hosts " * 6
    clef.clear_cache()
    prepared = clef.prepare(body(state, x_independent=True))
    assert isinstance(prepared, IndependentRequest)
    response = clef.decide_encoded([prepared])[0]
    parts = [part.record for part in prepared.parts]
    prefix = clef.prefix_state.length
    state_end = parts[0].state_end
    assert all(record.state_end == state_end for record in parts)
    schema = sum(record.input_tokens - record.state_end for record in parts)
    assert clef.last_timings.backbone_tokens == (state_end - prefix) + schema
    assert response.timings.backbone_tokens == (state_end - prefix) + schema
    assert response.input_tokens == sum(record.input_tokens for record in parts)
    assert response.cache.status == "partial"  # the first part computed the state, the others reused it
    again = clef.decide_encoded([clef.prepare(body(state, x_independent=True))])[0]
    assert again.cache.status == "hit" and again.timings.backbone_tokens == schema


def test_the_response_keeps_the_request_order_and_sums_usage(clef: Clef) -> None:
    response = clef.decide(body("short state", x_independent=True, model="jev-latest"))
    assert list(response["answers"]) == list(QUESTIONS)
    assert response["model"] == "jev-latest"
    assert response["usage"]["input_tokens"] == sum(
        clef.encode(single("short state", q)).input_tokens for q in QUESTIONS
    )


def test_one_question_or_false_is_an_ordinary_request(clef: Clef) -> None:
    assert isinstance(clef.prepare(single("s", "billing") | {"x_independent": True}), PreparedRequest)
    assert isinstance(clef.prepare(body("s", x_independent=False)), PreparedRequest)


@pytest.mark.parametrize("value", ["yes", 1, None, {}])
def test_x_independent_must_be_a_boolean(value: Any) -> None:
    with pytest.raises(RequestValidationError) as caught:
        parse_request(body("s", x_independent=value))
    assert caught.value.errors[0]["loc"] == ("x_independent",)


def _decision(question_id: str, status: str, tokens: int) -> Decision:
    return Decision(
        model="m",
        answers={question_id: {"answer": True}},
        input_tokens=tokens,
        cache=CacheReport(status, tokens // 2),
        timings=RequestTimings(queue_s=0.1, compute_s=0.2, steps=2, backbone_tokens=tokens),
        probabilities=[[0.5, 0.5]],
    )


def test_merge_orders_answers_and_reports_the_cache_of_all_parts() -> None:
    request = parse_request(body("s", x_independent=True))
    merged = merge_decisions(
        request,
        [_decision("urgency", "hit", 10), _decision("billing", "miss", 20), _decision("team", "hit", 4)],
    )
    assert list(merged.answers) == list(QUESTIONS)
    assert merged.input_tokens == 34 and merged.cache == CacheReport("partial", 17)
    assert merged.timings.backbone_tokens == 34 and merged.timings.steps == 2
    hits = merge_decisions(request, [_decision(q, "hit", 2) for q in QUESTIONS])
    assert hits.cache.status == "hit"


def test_cancelling_the_request_cancels_every_part_and_a_failing_part_fails_it() -> None:
    request = parse_request(body("s", x_independent=True))
    item = IndependentRequest(request, ("p1", "p2", "p3"))
    futures: list[Future[Decision]] = []

    def submit(part: str) -> Future[Decision]:
        futures.append(Future())
        return futures[-1]

    merged = submit_parts(item, submit)
    assert merged.cancel()
    assert all(future.cancelled() for future in futures)

    futures.clear()
    merged = submit_parts(item, submit)
    futures[0].set_result(_decision("billing", "miss", 3))
    futures[1].set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        merged.result(timeout=1)
    assert futures[2].cancelled()

    calls: list[str] = []

    def full_after_one(part: str) -> Future[Decision]:
        if calls:
            raise RuntimeError("queue full")
        calls.append(part)
        futures.append(Future())
        return futures[-1]

    futures.clear()
    with pytest.raises(RuntimeError, match="queue full"):
        submit_parts(item, full_after_one)
    assert futures[0].cancelled()
