"""Temperature fitting recovers a known temperature from synthetic data generated here: labels drawn from
softmax(z), the "model" reporting softmax(T0 * z) (over-confident for T0 > 1); the fit must find T ~ T0,
since the calibrated probabilities softmax(ln p / T) = softmax(T0 * z / T) equal the true ones at T = T0."""

from __future__ import annotations

import numpy as np
import pytest

from clef_runtime.engine.calibration import Calibration
from clef_runtime.evaluation.calibrate import MIN_QUESTION_CASES, fit_calibration, fit_temperature, mean_nll
from clef_runtime.evaluation.metrics import Outcome
from clef_runtime.evaluation.runner import calibrated_outcomes


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def synthetic(
    rng: np.random.Generator, n: int, kind: str, options: int, true_t: float, qid: str | None = None
) -> list[Outcome]:
    """``n`` outcomes whose labels follow softmax(z) while the reported probabilities are softmax(T0 * z)."""
    outcomes = []
    for i in range(n):
        z = rng.normal(0.0, 1.5, size=options)
        label = int(rng.choice(options, p=softmax(z)))
        reported = softmax(z * true_t)
        ids = ("true", "false") if kind == "noul" else tuple(str(k) for k in range(options))
        outcomes.append(Outcome(f"c{i}", qid or kind, kind, ids, reported, label))
    return outcomes


@pytest.mark.parametrize(
    ("kind", "options", "true_t"), [("noul", 2, 0.5), ("choice", 4, 2.0), ("score", 5, 1.6)]
)
def test_fit_recovers_a_known_temperature(kind: str, options: int, true_t: float) -> None:
    rng = np.random.default_rng(11)
    outcomes = synthetic(rng, 6000, kind, options, true_t)
    fitted = fit_temperature(outcomes)
    assert fitted == pytest.approx(true_t, rel=0.06)
    # and the fit is the minimum: nudging T either way raises the NLL
    nll = {
        t: mean_nll(outcomes, Calibration(temperatures={kind: t}))
        for t in (fitted * 0.9, fitted, fitted * 1.1)
    }
    assert nll[fitted] < nll[fitted * 0.9] and nll[fitted] < nll[fitted * 1.1]


def test_fit_calibration_per_type_and_per_question() -> None:
    rng = np.random.default_rng(3)
    outcomes = (
        synthetic(rng, 3000, "choice", 3, 2.0)
        + synthetic(rng, 3000, "choice", 3, 0.7, qid="special")
        + synthetic(rng, MIN_QUESTION_CASES - 1, "choice", 3, 5.0, qid="rare")
        + synthetic(rng, 3000, "noul", 2, 1.5)
    )
    outcomes.append(Outcome("u", "unscored", "score", ("0", "1"), np.array([0.5, 0.5]), None))
    calibration, document = fit_calibration(outcomes, fitted_on={"cases": 9029, "model": "synthetic"})
    assert set(calibration.questions) == {"special", "choice", "noul"}  # "rare" has 29 cases: no T of its own
    assert calibration.questions["special"] == pytest.approx(0.7, rel=0.08)
    assert calibration.questions["choice"] == pytest.approx(2.0, rel=0.08)
    assert calibration.temperatures["score"] == 1.0  # no scored score question: left unchanged
    assert calibration.temperature("rare", "choice") == calibration.temperatures["choice"]
    assert document["version"] == 1
    assert set(document["temperatures"]) == {"noul", "choice", "score"}
    assert document["fitted_on"]["cases"] == 9029 and document["fitted_on"]["model"] == "synthetic"
    assert document["nll_after"] < document["nll_before"]
    assert document["nll_after"] == pytest.approx(mean_nll(outcomes, calibration))
    # the file round-trips through the loader the engine uses
    again = Calibration.from_json(document)
    assert again.temperatures == calibration.temperatures and again.questions == calibration.questions


def test_calibrated_outcomes_apply_the_formula() -> None:
    outcome = Outcome("c", "q", "choice", ("a", "b", "c"), np.array([0.7, 0.2, 0.1]), 0)
    (scaled,) = calibrated_outcomes([outcome], Calibration(temperatures={"choice": 2.0}).apply)
    expected = np.sqrt([0.7, 0.2, 0.1]) / np.sqrt([0.7, 0.2, 0.1]).sum()
    np.testing.assert_allclose(scaled.probs, expected, rtol=0, atol=1e-15)


def test_fit_needs_scored_outcomes() -> None:
    with pytest.raises(ValueError):
        fit_calibration([Outcome("c", "q", "noul", ("true", "false"), np.array([0.5, 0.5]), None)])
