"""The objective against hand-written formulas: label-smoothed cross-entropy, Brier and the ordinal term per
scored question over its own options; unscored questions do not count; the NLL is clef eval's."""

from __future__ import annotations

import math

import pytest
import torch

from clef_runtime.model.head import HeadLayout
from clef_runtime.tuning.objective import LossWeights, QuestionIndex, question_losses, question_nll
from clef_runtime.tuning.rows import QuestionTarget, TuneRow


def _question(kind: str, count: int, target: int | None) -> QuestionTarget:
    options = tuple(str(i) for i in range(count))
    return QuestionTarget("q" + kind, kind, options, options, target)


def _row(*questions: QuestionTarget) -> TuneRow:
    spans = [[(k, k + 1) for k in range(len(q.head_options))] for q in questions]
    layout = HeadLayout(
        type_ids=[0] * len(questions), question_spans=[(0, 1)] * len(questions), option_spans=spans
    )
    return TuneRow(0, "c", "k", layout, questions)


def _by_hand(logits: list[float], target: int, weights: LossWeights, score: bool) -> float:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    p = [e / sum(exps) for e in exps]
    k = len(p)
    e = weights.label_smoothing
    ce = -sum(((1 - e) * (i == target) + e / k) * math.log(p[i]) for i in range(k))
    brier = sum((p[i] - (i == target)) ** 2 for i in range(k))
    ordinal = sum(p[i] * abs(i - target) for i in range(k)) / (k - 1) if score else 0.0
    return ce + weights.brier_weight * brier + weights.ordinal_weight * ordinal


def test_losses_match_the_formulas() -> None:
    rows = [
        _row(_question("noul", 2, 1), _question("choice", 3, None), _question("score", 5, 3)),
        _row(_question("choice", 4, 0)),
    ]
    logits = torch.tensor([0.3, -0.2, 1.0, 2.0, 0.5, -1.0, 0.0, 1.5, 0.7, 0.1, 0.4, 0.2, -0.3, 0.9])
    weights = LossWeights(label_smoothing=0.1, brier_weight=0.7, ordinal_weight=0.4)
    index = QuestionIndex.build(rows)
    assert index.num_questions == 3  # the unscored choice question is left out
    losses = question_losses(logits, index, weights)
    expected = [
        _by_hand([0.3, -0.2], 1, weights, score=False),
        _by_hand([-1.0, 0.0, 1.5, 0.7, 0.1], 3, weights, score=True),
        _by_hand([0.4, 0.2, -0.3, 0.9], 0, weights, score=False),
    ]
    assert losses.tolist() == pytest.approx(expected, abs=1e-5)
    nll = question_nll(logits, index)
    assert nll.tolist() == pytest.approx(
        [
            -math.log(torch.softmax(logits[s], 0)[t].item())
            for s, t in ((slice(0, 2), 1), (slice(5, 10), 3), (slice(10, 14), 0))
        ],
        abs=1e-5,
    )


def test_gradients_are_finite_with_padded_questions() -> None:
    rows = [_row(_question("noul", 2, 0), _question("score", 6, 5))]
    logits = torch.randn(8, requires_grad=True)
    question_losses(logits, QuestionIndex.build(rows), LossWeights()).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_nll_is_floored_like_the_metric() -> None:
    index = QuestionIndex.build([_row(_question("noul", 2, 1))])
    assert question_nll(torch.tensor([100.0, -100.0]), index).item() == pytest.approx(-math.log(1e-12))


def test_weights_are_checked() -> None:
    with pytest.raises(ValueError, match="label smoothing"):
        LossWeights(label_smoothing=1.0)
    with pytest.raises(ValueError, match="at least 0"):
        LossWeights(brier_weight=-1)
