"""``--calibration`` over HTTP: the served probabilities are softmax(ln p / T) of the uncalibrated model's,
the response says which calibration answered (``x_calibration``) and ``/v1/models`` shows it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from clef_runtime.engine.calibration import Calibration
from clef_runtime.engine.clef import Clef
from tests.server.conftest import Served

REQUEST = {
    "state": {"post": "Congratulations! You won a gift card. Send your bank login to claim it."},
    "questions": {
        "remove": {"type": "noul", "instructions": "Should the post be removed?"},
        "violation": {"type": "choice", "criteria": {"none": None, "spam": None, "scam": "deceit for money"}},
        "severity": {"type": "score", "criteria": ["low", "medium", "high"]},
    },
}
TEMPERATURES = {"noul": 0.4, "choice": 3.0, "score": 2.0}


def formula(probs: list[float], t: float) -> np.ndarray:
    logits = np.log(np.asarray(probs)) / t
    e = np.exp(logits - logits.max())
    return e / e.sum()


@pytest.mark.slow
def test_served_probabilities_follow_the_formula(serve_fake: Callable[..., Served], tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"version": 1, "temperatures": TEMPERATURES}), encoding="utf-8")
    raw_engine = Clef.load("tiny", dtype="fp32", cache_mb=0)
    item = raw_engine.prepare(REQUEST)
    raw = raw_engine.probabilities_encoded([item])[0]
    expected = {
        q.question_id: dict(zip(q.option_ids, formula(p, TEMPERATURES[q.question_type]), strict=True))
        for q, p in zip(item.record.questions, raw, strict=True)
    }

    served = serve_fake(engine=Clef.load("tiny", dtype="fp32", cache_mb=0, calibration=str(path)))
    response = served.client.post("/v1/systemone", json=REQUEST)
    assert response.status_code == 200, response.text
    body = response.json()
    label = Calibration.load(path).label
    assert body["x_calibration"] == label
    answers = body["answers"]
    assert answers["remove"]["noul"] == pytest.approx(round(expected["remove"]["true"], 4), abs=1e-12)
    choice = expected["violation"]
    assert answers["violation"]["probabilities"] == {
        k: pytest.approx(round(v, 4), abs=1e-12) for k, v in choice.items()
    }
    assert answers["violation"]["confidence"] == pytest.approx(round(max(choice.values()), 4), abs=1e-12)
    levels = expected["severity"]
    assert answers["severity"]["score"] == pytest.approx(
        round(sum(int(k) * p for k, p in levels.items()), 4), abs=1e-12
    )
    # the calibration really moved the numbers away from the raw ones
    raw_noul = dict(zip(item.record.questions[0].option_ids, raw[0], strict=True))["true"]
    assert abs(answers["remove"]["noul"] - raw_noul) > 1e-3

    models = served.client.get("/v1/models").json()
    shown = models["data"][0]["x_calibration"]
    assert "x_calibration" not in models["models"][0]  # the Jev model card keeps its exact shape
    assert shown["label"] == label and shown["temperatures"] == TEMPERATURES and shown["file"] == "cal.json"


def test_models_without_calibration_show_null(client: object) -> None:
    models = client.get("/v1/models").json()  # type: ignore[attr-defined]
    assert models["data"][0]["x_calibration"] is None
