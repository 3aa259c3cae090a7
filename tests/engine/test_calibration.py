"""Calibration at serving time: the file's validation, the formula softmax(ln p / T) (question id first,
else type), and the tiny model's answers with ``calibration=``: probabilities, confidence, score and noul
equal the formula applied here (numpy) to the uncalibrated engine's probabilities."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clef_runtime.cli import main
from clef_runtime.engine.calibration import Calibration, CalibrationError, temperature_scale
from clef_runtime.engine.clef import Clef
from clef_runtime.options import OptionsError

REQUEST = {
    "state": "Charged twice for my March invoice, please refund today.",
    "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {"type": "choice", "criteria": {"tech": None, "billing": "charges", "sales": None}},
        "urgency": {"type": "score", "criteria": ["can wait", "this week", "today", "now"]},
        "lang": {"type": "choice", "criteria": {"en": None, "fr": None}},
    },
}
FILE = {"version": 1, "temperatures": {"noul": 0.5, "choice": 2.5, "score": 1.7}, "questions": {"lang": 0.3}}


def formula(probs: list[float], t: float) -> np.ndarray:
    logits = np.log(np.asarray(probs, dtype=float)) / t
    e = np.exp(logits - logits.max())
    return e / e.sum()


def write(tmp_path: Path, data: Any, name: str = "calibration.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def test_temperature_scale_matches_the_formula() -> None:
    probs = [0.6, 0.25, 0.1, 0.05]
    for t in (0.3, 1.0, 2.0, 7.5):
        np.testing.assert_allclose(temperature_scale(probs, t), formula(probs, t), rtol=0, atol=1e-15)
    assert temperature_scale([0.0, 1.0], 2.0) == [0.0, 1.0]  # ln 0 = -inf stays at 0
    flattened = temperature_scale(probs, 3.0)
    assert int(np.argmax(flattened)) == 0 and max(flattened) < 0.6


def test_question_id_beats_type_beats_one() -> None:
    calibration = Calibration.from_json(FILE)
    assert calibration.temperature("lang", "choice") == 0.3
    assert calibration.temperature("team", "choice") == 2.5
    assert Calibration.from_json({"version": 1, "temperatures": {}}).temperature("x", "noul") == 1.0


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not a JSON file"),
        ([1, 2], "JSON object"),
        ({"temperatures": {"noul": 1}}, "version must be 1"),
        ({"version": 1}, "temperatures must be an object"),
        ({"version": 1, "temperatures": {"binary": 1.0}}, "temperatures.binary: unknown question type"),
        ({"version": 1, "temperatures": {"noul": -1}}, "temperatures.noul must be a positive finite number"),
        ({"version": 1, "temperatures": {"noul": 0}}, "temperatures.noul must be a positive"),
        ({"version": 1, "temperatures": {"noul": True}}, "temperatures.noul must be a number"),
        ({"version": 1, "temperatures": {"noul": "2"}}, "temperatures.noul must be a number"),
        ({"version": 1, "temperatures": {}, "questions": {"q": None}}, "questions.q must be a number"),
        ({"version": 1, "temperatures": {}, "questions": []}, "questions must be an object"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, content: Any, needle: str) -> None:
    path = write(tmp_path, content)
    with pytest.raises(CalibrationError, match=needle) as caught:
        Calibration.load(path)
    assert str(path) in str(caught.value)
    assert isinstance(caught.value, OptionsError)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="cannot read"):
        Calibration.load(tmp_path / "nope.json")


def test_label_names_the_file_and_its_digest(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)
    calibration = Calibration.load(path)
    import hashlib

    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert calibration.label == f"calibration.json@sha256:{digest[:12]}"
    assert calibration.describe()["temperatures"] == FILE["temperatures"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Clef, Clef, Path]:
    path = write(tmp_path_factory.mktemp("calibration"), FILE)
    return (
        Clef.load("tiny", dtype="fp32", cache_mb=0),
        Clef.load("tiny", dtype="fp32", cache_mb=0, calibration=str(path)),
        path,
    )


@pytest.mark.slow
def test_calibrated_engine_serves_the_formula(engines: tuple[Clef, Clef, Path]) -> None:
    raw_engine, calibrated, path = engines
    raw = raw_engine.probabilities_encoded([raw_engine.prepare(REQUEST)])[0]
    item = calibrated.prepare(REQUEST)
    served_unrounded = calibrated.probabilities_encoded([item])[0]
    expected = {}
    for q, probs, got in zip(item.record.questions, raw, served_unrounded, strict=True):
        t = FILE["questions"].get(q.question_id, FILE["temperatures"][q.question_type])
        want = formula(probs, t)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        assert not np.allclose(got, probs, atol=1e-4)  # the calibration really changed them
        expected[q.question_id] = dict(zip(q.option_ids, want, strict=True))

    response = calibrated.decide(REQUEST)
    assert response["x_calibration"] == Calibration.load(path).label
    answers = response["answers"]
    assert answers["refund"]["noul"] == pytest.approx(round(expected["refund"]["true"], 4), abs=1e-12)
    for qid in ("team", "lang"):
        probs = expected[qid]
        assert answers[qid]["probabilities"] == {
            k: pytest.approx(round(p, 4), abs=1e-12) for k, p in probs.items()
        }
        assert answers[qid]["choice"] == max(REQUEST["questions"][qid]["criteria"], key=probs.__getitem__)
        assert answers[qid]["confidence"] == pytest.approx(round(max(probs.values()), 4), abs=1e-12)
    levels = expected["urgency"]
    assert answers["urgency"]["score"] == pytest.approx(
        round(sum(int(k) * p for k, p in levels.items()), 4), abs=1e-12
    )
    assert answers["urgency"]["confidence"] == pytest.approx(round(max(levels.values()), 4), abs=1e-12)
    assert "x_calibration" not in raw_engine.decide(REQUEST)


@pytest.mark.slow
def test_cli_decide_with_calibration(
    engines: tuple[Clef, Clef, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, calibrated, path = engines
    request = write(tmp_path, REQUEST, "request.json")
    assert (
        main(["decide", "--model", "tiny", "--cache-mb", "0", "--calibration", str(path), str(request)]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out == calibrated.decide(REQUEST)


def test_cli_bad_calibration_exits_2_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(tmp_path, {"version": 1, "temperatures": {"noul": -2}})
    request = write(tmp_path, REQUEST, "request.json")
    assert main(["decide", "--model", "/nonexistent/model", "--calibration", str(bad), str(request)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "temperatures.noul must be a positive finite number" in err[0]
    assert main(["serve", "--model", "tiny", "--calibration", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
