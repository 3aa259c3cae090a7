"""Every metric of `clef_runtime.evaluation.metrics` against an independent computation written here, on
hand-made probabilities (plain Python loops, no numpy, no scikit-learn)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from clef_runtime.evaluation.metrics import Outcome, group_metrics, percentiles, summarize


def noul(p: float, expected: bool | None, qid: str = "n") -> Outcome:
    return Outcome(
        "c",
        qid,
        "noul",
        ("true", "false"),
        np.array([p, 1 - p]),
        None if expected is None else (0 if expected else 1),
    )


def multi(kind: str, probs: list[float], expected: int, qid: str = "q") -> Outcome:
    options = tuple(str(i) for i in range(len(probs))) if kind == "score" else tuple("abcdefgh"[: len(probs)])
    return Outcome("c", qid, kind, options, np.array(probs), expected)


# ------------------------------------------------------------------------------ the reference computations


def ref_predicted(o: Outcome) -> int:
    if o.question_type == "noul":
        return 0 if o.probs[0] >= 0.5 else 1
    probs = list(o.probs)
    best = 0
    for i, p in enumerate(probs):
        if p > probs[best]:
            best = i
    return best


def ref_confidence(o: Outcome) -> float:
    if o.question_type == "noul":
        return max(o.probs[0], 1 - o.probs[0])
    return max(o.probs)


def ref_metrics(outcomes: list[Outcome]) -> dict[str, float]:
    n = len(outcomes)
    correct = [ref_predicted(o) == o.expected for o in outcomes]
    brier = 0.0
    nll = 0.0
    for o in outcomes:
        brier += sum((p - (1.0 if k == o.expected else 0.0)) ** 2 for k, p in enumerate(o.probs))
        nll += -math.log(max(o.probs[o.expected], 1e-12))
    bins: dict[int, list[tuple[float, bool]]] = {}
    for o, ok in zip(outcomes, correct, strict=True):
        c = ref_confidence(o)
        b = 9 if c >= 1.0 else int(c * 10)
        bins.setdefault(b, []).append((c, ok))
    ece, mce = 0.0, 0.0
    for members in bins.values():
        acc = sum(ok for _, ok in members) / len(members)
        conf = sum(c for c, _ in members) / len(members)
        ece += len(members) / n * abs(acc - conf)
        mce = max(mce, abs(acc - conf))
    return {"n": n, "accuracy": sum(correct) / n, "brier": brier / n, "nll": nll / n, "ece": ece, "mce": mce}


def ref_macro_f1(outcomes: list[Outcome]) -> float:
    truth = [(o.question_id, o.expected) for o in outcomes]
    guess = [(o.question_id, ref_predicted(o)) for o in outcomes]
    labels = set(truth) | set(guess)
    scores = []
    for label in labels:
        tp = sum(t == label and g == label for t, g in zip(truth, guess, strict=True))
        fp = sum(t != label and g == label for t, g in zip(truth, guess, strict=True))
        fn = sum(t == label and g != label for t, g in zip(truth, guess, strict=True))
        precision = tp / (tp + fp) if tp + fp else 0.0
        recall = tp / (tp + fn) if tp + fn else 0.0
        scores.append(2 * precision * recall / (precision + recall) if precision + recall else 0.0)
    return sum(scores) / len(scores)


def assert_matches(got: dict[str, object], want: dict[str, float]) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


# --------------------------------------------------------------------------------------------- the tests


def test_worked_noul_example_by_hand() -> None:
    # Bins: 0.95 alone in bin 9 (correct), 0.75 (wrong) and 0.72 (correct) in bin 7, 1 - 0.35 = 0.65 in bin 6.
    outcomes = [noul(0.95, True), noul(0.75, False), noul(0.72, True), noul(0.35, False)]
    got = group_metrics(outcomes)
    assert got["n"] == 4
    assert got["accuracy"] == pytest.approx(0.75)
    assert got["brier"] == pytest.approx((2 * 0.05**2 + 2 * 0.75**2 + 2 * 0.28**2 + 2 * 0.35**2) / 4)
    assert got["nll"] == pytest.approx(
        -(math.log(0.95) + math.log(0.25) + math.log(0.72) + math.log(0.65)) / 4
    )
    assert got["ece"] == pytest.approx(0.25 * 0.05 + 0.5 * abs(0.5 - 0.735) + 0.25 * 0.35)
    assert got["mce"] == pytest.approx(0.35)  # the single-case bin 6 has the largest gap
    bins = {b["lower"]: b for b in got["reliability"] if b["n"]}
    assert [round(k, 1) for k in bins] == [0.6, 0.7, 0.9]
    assert (
        bins[0.9]["n"] == 1
        and bins[0.9]["accuracy"] == 1.0
        and bins[0.9]["confidence"] == pytest.approx(0.95)
    )
    assert "macro_f1" not in got and "mae" not in got


def test_noul_threshold_is_inclusive_at_one_half() -> None:
    assert group_metrics([noul(0.5, True)])["accuracy"] == 1.0
    assert group_metrics([noul(0.5, False)])["accuracy"] == 0.0
    assert group_metrics([noul(0.4999, False)])["accuracy"] == 1.0


def test_nll_clips_a_zero_probability_at_1e_12() -> None:
    got = group_metrics([noul(1.0, False), noul(0.5, True)])
    assert got["nll"] == pytest.approx((-math.log(1e-12) - math.log(0.5)) / 2)
    assert math.isfinite(got["nll"])
    assert got["brier"] == pytest.approx((2.0 + 0.5) / 2)


def test_all_correct_and_confident() -> None:
    outcomes = [multi("choice", [1.0, 0.0, 0.0], 0), multi("choice", [0.0, 1.0], 1, qid="r"), noul(1.0, True)]
    got = group_metrics(outcomes)
    assert got["accuracy"] == 1.0 and got["brier"] == 0.0 and got["ece"] == 0.0 and got["mce"] == 0.0
    assert got["nll"] == pytest.approx(0.0, abs=1e-15)
    assert got["reliability"][9]["n"] == 3  # confidence 1.0 falls in the last bin


def test_all_correct_but_unsure_ece_is_the_missing_confidence() -> None:
    outcomes = [multi("choice", [0.41, 0.3, 0.29], 0), multi("choice", [0.2, 0.55, 0.25], 1)]
    got = group_metrics(outcomes)
    assert got["accuracy"] == 1.0
    assert got["ece"] == pytest.approx(1 - (0.41 + 0.55) / 2)
    assert got["mce"] == pytest.approx(1 - 0.41)


def test_choice_ties_go_to_the_first_option_and_macro_f1_matches() -> None:
    outcomes = [
        multi("choice", [0.6, 0.3, 0.1], 0),
        multi("choice", [0.2, 0.5, 0.3], 2),
        multi("choice", [0.4, 0.4, 0.2], 1),  # tie: predicted a, wrong
        multi("choice", [0.1, 0.1, 0.8], 2),
        multi("choice", [0.3, 0.7], 1, qid="other"),  # another question: its labels are its own
    ]
    got = group_metrics(outcomes)
    assert got["accuracy"] == pytest.approx(3 / 5)
    assert got["macro_f1"] == pytest.approx(ref_macro_f1(outcomes))
    assert_matches(got, ref_metrics(outcomes))


def test_score_levels_mae_and_brier() -> None:
    outcomes = [
        multi("score", [0.1, 0.2, 0.3, 0.4], 3),
        multi("score", [0.7, 0.2, 0.1, 0.0], 0),
        multi("score", [0.25, 0.25, 0.25, 0.25], 2),
    ]
    got = group_metrics(outcomes)
    expected_scores = [0.2 + 0.6 + 1.2, 0.2 + 0.2, 1.5]
    assert got["mae"] == pytest.approx((abs(2.0 - 3) + abs(0.4 - 0) + abs(1.5 - 2)) / 3)
    assert expected_scores[0] == pytest.approx(2.0)
    # level 0 of the uniform case wins the tie: predicted 0, expected 2
    assert got["accuracy"] == pytest.approx(2 / 3)
    assert_matches(got, ref_metrics(outcomes))
    assert "macro_f1" not in got


def test_random_mixed_groups_match_the_reference() -> None:
    rng = random.Random(7)
    outcomes = []
    for i in range(300):
        kind = rng.choice(["noul", "choice", "score"])
        if kind == "noul":
            outcomes.append(noul(rng.random(), rng.random() < 0.5, qid=f"n{i % 3}"))
            continue
        size = rng.randint(2, 6)
        weights = [rng.random() ** 3 for _ in range(size)]
        probs = [w / sum(weights) for w in weights]
        outcomes.append(multi(kind, probs, rng.randrange(size), qid=f"{kind}{i % 4}"))
    assert_matches(group_metrics(outcomes), ref_metrics(outcomes))
    choices = [o for o in outcomes if o.question_type == "choice"]
    assert group_metrics(choices)["macro_f1"] == pytest.approx(ref_macro_f1(choices), abs=1e-12)


def test_coverage_table_counts_and_accuracy() -> None:
    outcomes = [noul(0.95, True), noul(0.75, False), noul(0.72, True), noul(0.35, False)]
    rows = {row["threshold"]: row for row in group_metrics(outcomes)["coverage"]}
    assert rows[0.0]["coverage"] == 1.0 and rows[0.0]["accuracy"] == 0.75
    assert rows[0.7]["n"] == 3 and rows[0.7]["accuracy"] == pytest.approx(2 / 3)
    assert rows[0.9]["n"] == 1 and rows[0.9]["accuracy"] == 1.0
    assert rows[0.99]["n"] == 0 and rows[0.99]["accuracy"] is None and rows[0.99]["coverage"] == 0.0


def test_summary_groups_and_unscored_questions() -> None:
    outcomes = [
        noul(0.9, True),
        noul(0.2, None),
        multi("choice", [0.6, 0.4], 1),
        multi("score", [0.5, 0.5], 1, "s"),
    ]
    summary = summarize(outcomes, [10.0, 20.0, 30.0, 40.0])
    assert summary["questions"] == {"answered": 4, "scored": 3}
    assert summary["overall"]["n"] == 3
    assert list(summary["by_type"]) == ["noul", "choice", "score"]
    assert set(summary["by_question"]) == {"n", "q", "s"}
    assert summary["by_question"]["n"]["n"] == 1
    assert {"n", "accuracy", "brier", "nll", "ece", "mce", "macro_f1"} <= set(summary["by_type"]["choice"])
    assert "mae" in summary["by_type"]["score"]
    assert summary["latency_ms"] == {"p50": 25.0, "p95": pytest.approx(40 - 0.05 * 3 * 10)}
    with pytest.raises(ValueError, match="nothing to score"):
        summarize([noul(0.2, None)])


def test_percentiles_of_nothing() -> None:
    assert percentiles([]) == {"p50": None, "p95": None}
