"""Quality and calibration metrics of answered cases, from their (unrounded) probabilities.

Definitions (per group of scored questions: overall, per type, per question id):

- accuracy: the predicted option is the expected one; the prediction is the argmax (the first maximum in
  answer order, as the served ``choice``), for noul ``p >= 0.5`` means true;
- brier: mean over questions of ``sum_k (p_k - 1[k == expected])^2`` (noul: the two options true/false);
- nll: mean of ``-ln p(expected)`` with p clipped at 1e-12;
- confidence: the top-1 probability (noul: ``max(p, 1 - p)``); ece: over 10 equal-width bins of the
  confidence (bin b holds [b/10, (b+1)/10), the last one includes 1), ``sum_b n_b/n * |acc_b - conf_b|``;
  mce: the largest of those gaps over non-empty bins;
- macro_f1 (choice groups only): scikit-learn's macro F1 over the labels present (``question_id/option``);
- mae (score groups only): mean ``|sum_i i*p_i - expected|``;
- coverage: answering only when the confidence is >= a threshold, the share answered and their accuracy.

Pure numpy (+ scikit-learn for F1): no model, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "COVERAGE_THRESHOLDS",
    "ECE_BINS",
    "NLL_FLOOR",
    "Outcome",
    "ScoredGroups",
    "group_metrics",
    "percentiles",
    "scored_groups",
    "summarize",
]

ECE_BINS = 10
NLL_FLOOR = 1e-12
COVERAGE_THRESHOLDS = (0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


@dataclass(frozen=True)
class Outcome:
    """One answered question: its probabilities in answer order (``options``) and, when scored, the index of
    the expected option. Noul questions hold ``[p, 1 - p]`` for ``("true", "false")``."""

    case_id: str
    question_id: str
    question_type: str
    options: tuple[str, ...]
    probs: np.ndarray
    expected: int | None = None

    @property
    def predicted(self) -> int:
        """The predicted option's index (noul: true when p >= 0.5)."""
        if self.question_type == "noul":
            return 0 if self.probs[0] >= 0.5 else 1
        return int(np.argmax(self.probs))

    @property
    def confidence(self) -> float:
        """The top-1 probability (noul: max(p, 1 - p))."""
        return float(np.max(self.probs))

    @property
    def margin(self) -> float:
        """Top-1 minus top-2 probability (noul: |2p - 1|)."""
        ordered = np.sort(self.probs)[::-1]
        return float(ordered[0] - ordered[1]) if len(ordered) > 1 else float(ordered[0])


def _reliability(confidence: np.ndarray, correct: np.ndarray) -> list[dict[str, Any]]:
    index = np.minimum((confidence * ECE_BINS).astype(int), ECE_BINS - 1)
    bins = []
    for b in range(ECE_BINS):
        mask = index == b
        count = int(mask.sum())
        bins.append(
            {
                "lower": b / ECE_BINS,
                "upper": (b + 1) / ECE_BINS,
                "n": count,
                "accuracy": float(correct[mask].mean()) if count else None,
                "confidence": float(confidence[mask].mean()) if count else None,
            }
        )
    return bins


def _coverage(confidence: np.ndarray, correct: np.ndarray) -> list[dict[str, Any]]:
    rows = []
    for threshold in COVERAGE_THRESHOLDS:
        mask = confidence >= threshold
        count = int(mask.sum())
        rows.append(
            {
                "threshold": threshold,
                "n": count,
                "coverage": count / len(confidence),
                "accuracy": float(correct[mask].mean()) if count else None,
            }
        )
    return rows


def _macro_f1(outcomes: Sequence[Outcome]) -> float:
    from sklearn.metrics import f1_score

    # Labels carry their question id: option "yes" of two different questions are different classes.
    truth = [f"{o.question_id}/{o.options[o.expected]}" for o in outcomes if o.expected is not None]
    guess = [f"{o.question_id}/{o.options[o.predicted]}" for o in outcomes if o.expected is not None]
    return float(f1_score(truth, guess, average="macro", zero_division=0))


def group_metrics(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The metrics of a group of scored outcomes (see the module docstring): ``n``, ``accuracy``,
    ``brier``, ``nll``, ``ece``, ``mce``, ``macro_f1`` (all choice), ``mae`` (all score), ``reliability``
    (the 10 bins) and ``coverage`` (the threshold table). Raises ValueError for an empty or unscored group.
    """
    if not outcomes or any(o.expected is None for o in outcomes):
        raise ValueError("group_metrics needs at least one outcome, all scored")
    expected = np.array([o.expected for o in outcomes])
    correct = np.array([o.predicted == o.expected for o in outcomes], dtype=float)
    confidence = np.array([o.confidence for o in outcomes])
    brier = [float(np.sum((o.probs - np.eye(len(o.probs))[o.expected]) ** 2)) for o in outcomes]
    p_expected = np.array([o.probs[e] for o, e in zip(outcomes, expected, strict=True)])
    bins = _reliability(confidence, correct)
    gaps = [abs(b["accuracy"] - b["confidence"]) for b in bins if b["n"]]
    weights = [b["n"] / len(outcomes) for b in bins if b["n"]]
    result: dict[str, Any] = {
        "n": len(outcomes),
        "accuracy": float(correct.mean()),
        "brier": float(np.mean(brier)),
        "nll": float(np.mean(-np.log(np.clip(p_expected, NLL_FLOOR, None)))),
        "ece": float(sum(w * g for w, g in zip(weights, gaps, strict=True))),
        "mce": float(max(gaps)),
    }
    types = {o.question_type for o in outcomes}
    if types == {"choice"}:
        result["macro_f1"] = _macro_f1(outcomes)
    if types == {"score"}:
        scores = np.array([float(np.dot(np.arange(len(o.probs)), o.probs)) for o in outcomes])
        result["mae"] = float(np.mean(np.abs(scores - expected)))
    result["reliability"] = bins
    result["coverage"] = _coverage(confidence, correct)
    return result


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """``{"p50", "p95"}`` of ``values`` (numpy's linear interpolation); None for no values."""
    array = np.asarray(list(values), dtype=float)
    if array.size == 0:
        return {"p50": None, "p95": None}
    return {"p50": float(np.percentile(array, 50)), "p95": float(np.percentile(array, 95))}


@dataclass(frozen=True)
class ScoredGroups:
    """The outcomes that have an expected answer, all together and grouped by question type and by
    question id (each group in the order of the outcomes)."""

    scored: list[Outcome]
    by_type: dict[str, list[Outcome]]
    by_question: dict[str, list[Outcome]]


def scored_groups(outcomes: Sequence[Outcome], purpose: str) -> ScoredGroups:
    """`ScoredGroups` of ``outcomes``. Raises ValueError naming ``purpose`` (what there would be nothing
    to do: "score", "fit") when no outcome has an expected answer."""
    scored = [o for o in outcomes if o.expected is not None]
    if not scored:
        raise ValueError(f"no question has an expected answer: nothing to {purpose}")
    by_type: dict[str, list[Outcome]] = {}
    by_question: dict[str, list[Outcome]] = {}
    for outcome in scored:
        by_type.setdefault(outcome.question_type, []).append(outcome)
        by_question.setdefault(outcome.question_id, []).append(outcome)
    return ScoredGroups(scored, by_type, by_question)


def summarize(outcomes: Sequence[Outcome], latencies_ms: Iterable[float] = ()) -> dict[str, Any]:
    """The ``clef eval --json`` object: ``overall``, ``by_type`` (noul/choice/score present), ``by_question``
    (question id -> metrics), ``latency_ms`` (p50/p95) and ``questions`` (answered / scored counts).

    Raises ValueError when no outcome is scored (nothing to measure).
    """
    groups = scored_groups(outcomes, "score")
    scored, by_type, by_question = groups.scored, groups.by_type, groups.by_question
    return {
        "overall": group_metrics(scored),
        "by_type": {
            kind: group_metrics(by_type[kind]) for kind in ("noul", "choice", "score") if kind in by_type
        },
        "by_question": {qid: group_metrics(group) for qid, group in by_question.items()},
        "latency_ms": percentiles(latencies_ms),
        "questions": {"answered": len(outcomes), "scored": len(scored)},
    }
