"""``x_explain`` through a saved classifier: ``POST /v1/classifiers/{name}/decide`` passes the option on to
the engine with the classifier's questions, answers with the evidence, and refuses a bad value naming it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from clef_runtime.protocol.explain import ExplainOptions
from tests.server.classifiers.test_classifiers_api import QUESTIONS, TICKET, save
from tests.server.conftest import Served
from tests.server.explaining_engine import FAKE_METHOD, ExplainingEngine
from tests.server.helpers import assert_validation_shape


def test_a_classifier_decision_passes_x_explain_on_and_returns_the_evidence(
    serve_fake: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve_fake(ExplainingEngine(), classifiers_db=str(tmp_path / "classifiers.sqlite3"))
    assert save(served.client).status_code == 201
    path = "/v1/classifiers/triage/decide"
    decided = served.client.post(path, json={"state": TICKET, "x_explain": {"top_k": 2}})
    assert decided.status_code == 200, decided.text
    assert served.engine.explained == [ExplainOptions(top_k=2)]  # type: ignore[attr-defined]
    body = decided.json()
    assert body["x_explain"]["method"] == FAKE_METHOD and body["x_classifier"]["name"] == "triage"
    assert set(body["answers"]) == set(QUESTIONS)
    assert all(1 <= len(answer["x_evidence"]) <= 2 for answer in body["answers"].values())

    refused = served.client.post(path, json={"state": TICKET, "x_explain": {"granularity": "page"}})
    assert [item["loc"] for item in assert_validation_shape(refused)] == [
        ["body", "x_explain", "granularity"]
    ]
