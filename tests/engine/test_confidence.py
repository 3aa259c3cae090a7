"""Confidence modes: each definition against an independent implementation on hand-made probabilities,
the published observations, and build_answer (computed from unrounded probabilities, noul untouched)."""

from __future__ import annotations

import math

import pytest

from clef_runtime.engine.answers import build_answer
from clef_runtime.engine.confidence import answer_confidence
from clef_runtime.protocol.systemone import ChoiceQuestion, NoulQuestion, ScoreQuestion


def seed_formula(p: list[float]) -> float:
    return max(p)


def typesafe_choice_formula(p: list[float]) -> float:
    n = len(p)
    return (max(p) - 1 / n) / (1 - 1 / n)


def typesafe_score_formula(p: list[float]) -> float:
    # Written from the definition: expected distance from the modal level, over the mean absolute
    # deviation of the uniform distribution from the middle level.
    n = len(p)
    k = p.index(max(p))
    expected_distance = sum(pi * abs(i - k) for i, pi in enumerate(p))
    middle = (n - 1) / 2
    uniform_mad = sum(abs(i - middle) for i in range(n)) / n
    return max(0.0, 1 - expected_distance / uniform_mad)


def workers_ai_formula(p: list[float]) -> float:
    n = len(p)
    return (n * sum(x**2 for x in p) - 1) / (n - 1)


HAND_MADE = [
    [0.8653, 0.0694, 0.0653],
    [0.9858, 0.0142],
    [0.16, 0.28, 0.33, 0.23],
    [0.1, 0.6, 0.3],
    [0.05, 0.05, 0.1, 0.2, 0.6],
    [0.5, 0.5],
    [0.25, 0.25, 0.25, 0.25],
    [1.0, 0.0, 0.0],
]


@pytest.mark.parametrize("p", HAND_MADE)
def test_each_mode_equals_its_formula(p: list[float]) -> None:
    assert answer_confidence("choice", p, "seed") == pytest.approx(seed_formula(p))
    assert answer_confidence("score", p, "seed") == pytest.approx(seed_formula(p))
    assert answer_confidence("choice", p, "typesafe") == pytest.approx(typesafe_choice_formula(p), abs=1e-12)
    assert answer_confidence("score", p, "typesafe") == pytest.approx(typesafe_score_formula(p), abs=1e-12)
    for kind in ("choice", "score"):
        assert answer_confidence(kind, p, "workers-ai") == pytest.approx(workers_ai_formula(p), abs=1e-12)


def test_published_observations() -> None:
    # Workers AI (browser-use-clef-flash docs/clef-verification.md): 0.6367 observed.
    assert round(answer_confidence("choice", [0.8653, 0.0694, 0.0653], "workers-ai"), 4) == 0.6367
    # ... and 0.9442 observed where the rounded probabilities give 0.9440.
    assert round(answer_confidence("choice", [0.9858, 0.0142], "workers-ai"), 4) == 0.9440
    # A measured Jev answer {0.16, 0.28, 0.33, 0.23} came with confidence 0.10 (chance-corrected 0.107).
    assert round(answer_confidence("choice", [0.16, 0.28, 0.33, 0.23], "typesafe"), 4) == 0.1067
    # Worked score example: mode 1, expected distance 0.4, uniform deviation 2/3 -> 1 - 0.6 = 0.4.
    assert answer_confidence("score", [0.1, 0.6, 0.3], "typesafe") == pytest.approx(0.4)


def test_uniform_is_zero_and_certain_is_one_outside_seed() -> None:
    for mode in ("typesafe", "workers-ai"):
        for kind in ("choice", "score"):
            assert answer_confidence(kind, [0.25] * 4, mode) == pytest.approx(0.0, abs=1e-12)
            assert answer_confidence(kind, [0.0, 1.0, 0.0], mode) == pytest.approx(1.0)
            assert 0.0 <= answer_confidence(kind, [0.3, 0.3, 0.4], mode) <= 1.0


def test_typesafe_score_floors_at_zero_and_normalises() -> None:
    # All mass at both ends: far from the (first) mode, below the uniform spread -> clipped to 0.
    assert answer_confidence("score", [0.5, 0.0, 0.0, 0.0, 0.5], "typesafe") == 0.0
    # Unnormalised input is normalised first (as the adapter library does).
    assert answer_confidence("choice", [2.0, 1.0, 1.0], "typesafe") == pytest.approx(
        typesafe_choice_formula([0.5, 0.25, 0.25])
    )


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown confidence mode"):
        answer_confidence("choice", [0.5, 0.5], "entropy")


CHOICE = ChoiceQuestion(
    type="choice", instructions="team?", criteria={"tech": None, "billing": None, "x": None}
)
SCORE = ScoreQuestion(type="score", instructions="urgency?", criteria=["low", "mid", "high"])
NOUL = NoulQuestion(type="noul", instructions="refund?")


@pytest.mark.parametrize(
    ("mode", "formula"),
    [("seed", seed_formula), ("typesafe", typesafe_choice_formula), ("workers-ai", workers_ai_formula)],
)
def test_build_answer_choice_uses_the_mode_on_unrounded_probabilities(mode: str, formula) -> None:
    # Model order is sorted ids (billing, tech, x); the request order is tech, billing, x.
    raw = {"billing": 0.61234567, "tech": 0.27654321, "x": 0.11111112}
    answer = build_answer(CHOICE, ["billing", "tech", "x"], [raw["billing"], raw["tech"], raw["x"]], mode)
    assert answer["choice"] == "billing"
    in_request_order = [raw["tech"], raw["billing"], raw["x"]]
    assert answer["confidence"] == round(formula(in_request_order), 4)


def test_confidence_comes_from_unrounded_probabilities() -> None:
    raw = [0.13436, 0.73357, 0.13207]
    rounded = [round(x, 4) for x in raw]
    exact = round(workers_ai_formula(raw), 4)
    assert exact != round(workers_ai_formula(rounded), 4)  # the test can tell the two apart
    answer = build_answer(SCORE, ["0", "1", "2"], raw, "workers-ai")
    assert answer["confidence"] == exact


@pytest.mark.parametrize(
    ("mode", "formula"),
    [("seed", seed_formula), ("typesafe", typesafe_score_formula), ("workers-ai", workers_ai_formula)],
)
def test_build_answer_score_uses_the_mode(mode: str, formula) -> None:
    raw = [0.2, 0.3, 0.5]
    answer = build_answer(SCORE, ["0", "1", "2"], raw, mode)
    assert answer["confidence"] == round(formula(raw), 4)
    assert answer["score"] == round(0.3 + 2 * 0.5, 4)  # the rest of the answer does not change


@pytest.mark.parametrize("mode", ["seed", "typesafe", "workers-ai"])
def test_noul_has_no_confidence_in_any_mode(mode: str) -> None:
    assert build_answer(NOUL, ["true", "false"], [0.7, 0.3], mode) == {"type": "noul", "noul": 0.7}


def test_default_is_seed() -> None:
    raw = [0.2, 0.3, 0.5]
    assert build_answer(SCORE, ["0", "1", "2"], raw)["confidence"] == 0.5
    assert math.isclose(answer_confidence("choice", raw), 0.5)
