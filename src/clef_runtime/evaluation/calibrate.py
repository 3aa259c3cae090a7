"""Fitting temperatures: one T per question type (and per question id with enough scored cases) minimising
the NLL of ``softmax(ln p / T)`` on a labelled case file.

With ``z = ln p`` (p clipped at 1e-12, as the NLL metric) and ``b = 1/T``, the NLL
``mean(logsumexp(b z) - b z_expected)`` is convex in ``b`` (a log-sum-exp of linear functions minus a linear
one), so a bounded scalar minimiser finds the optimum; T is kept in [0.05, 20].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from clef_runtime.engine.calibration import QUESTION_TYPES, Calibration
from clef_runtime.evaluation.metrics import NLL_FLOOR, Outcome, scored_groups

__all__ = ["MIN_QUESTION_CASES", "TEMPERATURE_BOUNDS", "fit_calibration", "fit_temperature", "mean_nll"]

#: A question id gets its own temperature from this many scored cases on.
MIN_QUESTION_CASES = 30
TEMPERATURE_BOUNDS = (0.05, 20.0)


def _padded_logs(outcomes: Sequence[Outcome]) -> tuple[np.ndarray, np.ndarray]:
    """``ln p`` of every outcome in one [n, max options] matrix (-inf pads) and the expected indexes."""
    width = max(len(o.probs) for o in outcomes)
    logs = np.full((len(outcomes), width), -np.inf)
    for row, outcome in enumerate(outcomes):
        logs[row, : len(outcome.probs)] = np.log(np.clip(outcome.probs, NLL_FLOOR, None))
    return logs, np.array([o.expected for o in outcomes], dtype=int)


def _nll(beta: float, logs: np.ndarray, expected: np.ndarray) -> float:
    from scipy.special import logsumexp

    scaled = beta * logs
    picked = scaled[np.arange(len(expected)), expected]
    return float(np.mean(logsumexp(scaled, axis=1) - picked))


def fit_temperature(outcomes: Sequence[Outcome]) -> float:
    """The temperature T in [0.05, 20] minimising the mean NLL of ``softmax(ln p / T)`` over ``outcomes``
    (all scored). Raises ValueError for no outcome or an unscored one."""
    from scipy.optimize import minimize_scalar

    if not outcomes or any(o.expected is None for o in outcomes):
        raise ValueError("fit_temperature needs scored outcomes")
    logs, expected = _padded_logs(outcomes)
    low, high = TEMPERATURE_BOUNDS
    found = minimize_scalar(
        _nll, bounds=(1 / high, 1 / low), args=(logs, expected), method="bounded", options={"xatol": 1e-9}
    )
    return float(1.0 / found.x)


def mean_nll(outcomes: Sequence[Outcome], calibration: Calibration | None = None) -> float:
    """The NLL metric (mean ``-ln p(expected)``, p clipped at 1e-12) of the scored ``outcomes``, after
    ``calibration`` when given."""
    total, count = 0.0, 0
    for o in outcomes:
        if o.expected is None:
            continue
        probs = (
            calibration.apply(o.question_id, o.question_type, o.probs.tolist()) if calibration else o.probs
        )
        total += -float(np.log(max(float(probs[o.expected]), NLL_FLOOR)))
        count += 1
    if not count:
        raise ValueError("no scored outcome")
    return total / count


def fit_calibration(
    outcomes: Sequence[Outcome], *, fitted_on: dict[str, Any] | None = None
) -> tuple[Calibration, dict[str, Any]]:
    """Fit a `Calibration` on the scored ``outcomes``: T per question type present (1 for the others), and
    per question id with at least `MIN_QUESTION_CASES` scored cases.

    Returns ``(calibration, file)``: ``file`` is the calibration.json object (``version``, ``temperatures``,
    ``questions``, ``fitted_on`` with the case/question counts merged into ``fitted_on``, ``nll_before``,
    ``nll_after``). Raises ValueError when nothing is scored.
    """
    groups = scored_groups(outcomes, "fit")
    scored, by_type, by_question = groups.scored, groups.by_type, groups.by_question
    temperatures = {
        kind: fit_temperature(by_type[kind]) if kind in by_type else 1.0 for kind in QUESTION_TYPES
    }
    questions = {
        qid: fit_temperature(group) for qid, group in by_question.items() if len(group) >= MIN_QUESTION_CASES
    }
    info = {
        **(fitted_on or {}),
        "scored_questions": len(scored),
        "by_type": {kind: len(group) for kind, group in by_type.items()},
    }
    calibration = Calibration(temperatures=temperatures, questions=questions, fitted_on=info)
    document = calibration.to_json(nll_before=mean_nll(scored), nll_after=mean_nll(scored, calibration))
    return calibration, document
