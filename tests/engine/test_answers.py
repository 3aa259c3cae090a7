"""Response shaping: the seed's ``decision.response`` on known probabilities."""

from __future__ import annotations

from typing import Any

from clef_runtime.encoding.encoder import EncodedQuestion, EncodedRecord
from clef_runtime.engine.answers import build_response
from clef_runtime.protocol.systemone import SystemOneResponse, parse_request


def record_for(questions: list[tuple[str, str, int, list[str]]], n_tokens: int = 100) -> EncodedRecord:
    return EncodedRecord(
        input_ids=tuple(range(n_tokens)),
        questions=tuple(
            EncodedQuestion(qid, qtype, type_id, (1, 2), tuple((3, 4) for _ in ids), tuple(ids))
            for qid, qtype, type_id, ids in questions
        ),
        truncated_state_tokens=0,
        state_start=36,
        state_end=50,
    )


REQUEST: dict[str, Any] = {
    "state": "s",
    "questions": {
        "n": {"type": "noul"},
        "c": {"type": "choice", "criteria": {"zeta": None, "alpha": "a", "Mid": {"x": 1}}},
        "s": {"type": "score", "criteria": ["low", {"mid": 1}, ["high"]]},
    },
}
RECORD = record_for(
    [
        ("n", "noul", 0, ["true", "false"]),
        ("c", "choice", 1, ["Mid", "alpha", "zeta"]),  # model order: sorted
        ("s", "score", 2, ["0", "1", "2"]),
    ],
    n_tokens=123,
)


def test_shapes_rounding_and_order() -> None:
    probs = [[0.123456, 0.876544], [0.2, 0.33333333, 0.46666667], [0.1, 0.25, 0.65]]
    response = build_response(parse_request(REQUEST), RECORD, probs, "tiny")
    assert response["model"] == "tiny"
    assert response["usage"] == {"input_tokens": 123, "output_tokens": 0}
    assert list(response["answers"]) == ["n", "c", "s"]
    assert response["answers"]["n"] == {"type": "noul", "noul": 0.1235}
    choice = response["answers"]["c"]
    assert list(choice["probabilities"]) == ["zeta", "alpha", "Mid"]  # the request's criteria order
    assert choice["probabilities"] == {"zeta": 0.4667, "alpha": 0.3333, "Mid": 0.2}
    assert choice["choice"] == "zeta"
    assert choice["confidence"] == 0.4667
    score = response["answers"]["s"]
    assert score["score"] == round(0 * 0.1 + 1 * 0.25 + 2 * 0.65, 4)
    assert score["confidence"] == 0.65
    assert score["legend"] == {"0": "low", "1": {"mid": 1}, "2": ["high"]}
    assert score["probabilities"] == {"0": 0.1, "1": 0.25, "2": 0.65}
    SystemOneResponse.model_validate(response)  # the wire model accepts it


def test_choice_ties_take_the_first_in_request_order() -> None:
    probs = [[0.5, 0.5], [0.4, 0.4, 0.2], [0.2, 0.4, 0.4]]  # model order Mid, alpha, zeta
    response = build_response(parse_request(REQUEST), RECORD, probs, "tiny")
    # Request order is zeta, alpha, Mid; alpha and Mid tie: alpha comes first in the request.
    assert response["answers"]["c"]["choice"] == "alpha"


def test_model_echoes_the_request() -> None:
    probs = [[0.5, 0.5], [0.2, 0.3, 0.5], [0.2, 0.4, 0.4]]
    response = build_response(parse_request(dict(REQUEST, model="jev-latest")), RECORD, probs, "tiny")
    assert response["model"] == "jev-latest"
