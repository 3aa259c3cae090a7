"""``x_explain`` on ``/v1/systemone`` and ``/v1/decisions``: the option reaches the engine as sent, the
engine's evidence comes back (each answer's ``x_evidence``, the body's ``x_explain``), and a bad value is a
422 naming the field. The engine is `ExplainingEngine` (made-up evidence): the method is tested elsewhere."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from clef_runtime.protocol.explain import ExplainOptions
from tests.server.conftest import Served
from tests.server.explaining_engine import FAKE_METHOD, ExplainingEngine
from tests.server.helpers import REQUEST, assert_validation_shape

DECISIONS_BODY: dict[str, Any] = {
    "input": "Charged twice, please refund today.",
    "questions": [
        {"type": "predicate", "name": "refund", "instructions": "The customer asks for a refund."},
        {
            "type": "choice",
            "name": "team",
            "instructions": "Which team?",
            "choices": [{"value": "billing"}, {"value": "tech"}],
        },
        {
            "type": "score",
            "name": "urgency",
            "instructions": "How urgent?",
            "levels": [{"label": "low"}, {"label": "high"}],
        },
    ],
}
ROUTES = {"/v1/systemone": REQUEST, "/v1/decisions": DECISIONS_BODY}
BAD_VALUES = [
    ({"top_k": 0}, ["body", "x_explain", "top_k"]),
    ({"top_k": 21}, ["body", "x_explain", "top_k"]),
    ({"top_k": "5"}, ["body", "x_explain", "top_k"]),
    ({"granularity": "line"}, ["body", "x_explain", "granularity"]),
    ({"top": 3}, ["body", "x_explain", "top"]),
    ("yes", ["body", "x_explain"]),
    (3, ["body", "x_explain"]),
]


@pytest.fixture
def explaining(serve_fake: Callable[..., Served]) -> Served:
    return serve_fake(ExplainingEngine())


def _with(body: dict[str, Any], x_explain: Any) -> dict[str, Any]:
    return {**copy.deepcopy(body), "x_explain": x_explain}


def _answers(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    answers = body["answers"]
    return list(answers.values()) if path == "/v1/systemone" else list(answers)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    ("sent", "received"),
    [
        (True, ExplainOptions()),
        ({"top_k": 3, "granularity": "field"}, ExplainOptions(top_k=3, granularity="field")),
        ({"granularity": "token"}, ExplainOptions(granularity="token")),
    ],
)
def test_x_explain_reaches_the_engine_and_its_evidence_comes_back(
    explaining: Served, path: str, sent: Any, received: ExplainOptions
) -> None:
    response = explaining.client.post(path, json=_with(ROUTES[path], sent))
    assert response.status_code == 200, response.text
    assert explaining.engine.explained == [received]  # type: ignore[attr-defined]
    body = response.json()
    assert body["x_explain"]["method"] == FAKE_METHOD
    assert body["x_explain"]["top_k"] == received.top_k
    assert body["x_explain"]["granularity"] == received.granularity
    answers = _answers(path, body)
    assert len(answers) == 3
    for answer in answers:
        spans = answer["x_evidence"]
        assert 1 <= len(spans) <= received.top_k
        assert all(set(span) >= {"text", "start", "end", "weight"} for span in spans)
        # A string state is its own rendered text; a JSON state's comes with the record.
        sent_state = ROUTES[path].get("state", ROUTES[path].get("input"))
        text = body["x_explain"].get("state_text", sent_state)
        assert all(text[span["start"] : span["end"]] == span["text"] for span in spans)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("off", [None, False, "absent"])
def test_without_x_explain_the_engine_gets_none_and_nothing_is_added(
    explaining: Served, path: str, off: Any
) -> None:
    body = copy.deepcopy(ROUTES[path]) if off == "absent" else _with(ROUTES[path], off)
    response = explaining.client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert explaining.engine.explained == [None]  # type: ignore[attr-defined]
    assert "x_explain" not in response.json()
    assert all("x_evidence" not in answer for answer in _answers(path, response.json()))


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(("value", "loc"), BAD_VALUES)
def test_a_bad_x_explain_is_a_422_naming_the_field(
    explaining: Served, path: str, value: Any, loc: list[Any]
) -> None:
    response = explaining.client.post(path, json=_with(ROUTES[path], value))
    detail = assert_validation_shape(response)
    assert [item["loc"] for item in detail] == [loc]
    assert explaining.engine.explained == []  # type: ignore[attr-defined]


def test_the_decisions_route_documents_x_explain(explaining: Served) -> None:
    schema = explaining.client.get("/openapi.json").json()["components"]["schemas"]["DecisionsRequest"]
    assert "x_evidence" in schema["properties"]["x_explain"]["description"]
