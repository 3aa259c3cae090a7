"""Attribution over the joint schema head's memory rows (`clef_runtime.model.attribution`) and the head's
hooks it stands on: each method is checked against what it claims to compute (a finite difference, the
completeness of integrated gradients, attention probabilities), on a randomized small head."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from clef_runtime.model import attribution
from clef_runtime.model.attribution import AttributionTarget, row_attributions, target_values
from clef_runtime.model.head import HeadLayout, JointSchemaHead
from tests.model.test_head import _random_record, _randomized_head

# One noul, one choice and one score question, in that order (their type ids).
TYPE_IDS = [0, 1, 2]
OPTION_COUNTS = [2, 4, 3]
TARGETS = [AttributionTarget(0, 1), AttributionTarget(1, 2), AttributionTarget(2, None)]


def _record(seed: int = 7) -> tuple[JointSchemaHead, Tensor, HeadLayout, Tensor, Tensor]:
    """A head, a record and its "state" rows: every row outside the question and option spans."""
    head = _randomized_head(seed, 1.0, 2.0, 0.5)
    hidden, layout, lexical = _random_record(seed, TYPE_IDS, OPTION_COUNTS)
    schema = {
        row
        for start, end in [*layout.question_spans, *(span for spans in layout.option_spans for span in spans)]
        for row in range(start, end)
    }
    rows = torch.tensor([row for row in range(hidden.shape[0]) if row not in schema])
    return head, hidden, layout, lexical, rows


def _targets_at(
    head: JointSchemaHead, hidden: Tensor, layout: HeadLayout, lexical: Tensor, memory: Tensor
) -> Tensor:
    """The targets with ``memory`` as the head's memory (no grad)."""
    with torch.no_grad():
        return target_values(head.logits_from_memory(hidden, layout, lexical, memory), layout, TARGETS)


def test_gradient_x_input_is_the_derivative_along_each_memory_row() -> None:
    head, hidden, layout, lexical, rows = _record()
    weights = row_attributions(head, hidden, layout, lexical, rows, TARGETS, "gradient_x_input")
    assert weights.shape == (len(TARGETS), rows.shape[0]) and weights.dtype == torch.float32
    memory = head.memory_rows(hidden)
    step = 1e-2
    estimate = torch.zeros_like(weights)
    for column, row in enumerate(rows.tolist()):
        # d target / d s of target(memory with row m_t scaled by s), at s = 1, is exactly grad . m_t.
        up, down = memory.clone(), memory.clone()
        up[row] *= 1 + step
        down[row] *= 1 - step
        estimate[:, column] = (
            _targets_at(head, hidden, layout, lexical, up) - _targets_at(head, hidden, layout, lexical, down)
        ) / (2 * step)
    scale = estimate.abs().max().item()
    assert scale > 1e-3  # the rows do move the answers
    # fp32: the difference quotient carries ~1e-5 of rounding; a wrong derivative is off by ~scale.
    torch.testing.assert_close(weights, estimate, rtol=0, atol=1e-2 * scale)


def _completeness_errors(steps: int, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Per target, |sum of the IG weights - (target(real) - target(explained rows zeroed))| with ``steps``."""
    monkeypatch.setattr(attribution, "IG_STEPS", steps)
    head, hidden, layout, lexical, rows = _record()
    weights = row_attributions(head, hidden, layout, lexical, rows, TARGETS, "integrated_gradients")
    memory = head.memory_rows(hidden)
    zeroed = memory.clone()
    zeroed[rows] = 0.0
    difference = _targets_at(head, hidden, layout, lexical, memory) - _targets_at(
        head, hidden, layout, lexical, zeroed
    )
    assert difference.abs().min().item() > 1e-3  # zeroing the rows changes every answer
    return (weights.sum(dim=1) - difference).abs().tolist()


def test_integrated_gradients_are_complete_up_to_the_midpoint_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    head, hidden, layout, lexical, rows = _record()
    memory = head.memory_rows(hidden)
    zeroed = memory.clone()
    zeroed[rows] = 0.0
    difference = _targets_at(head, hidden, layout, lexical, memory) - _targets_at(
        head, hidden, layout, lexical, zeroed
    )
    coarse = _completeness_errors(attribution.IG_STEPS, monkeypatch)
    fine = _completeness_errors(8 * attribution.IG_STEPS, monkeypatch)
    for number, (coarse_error, fine_error) in enumerate(zip(coarse, fine, strict=True)):
        assert coarse_error <= 0.05 * abs(difference[number].item()) + 1e-4
        assert fine_error < coarse_error or fine_error < 1e-5  # more points, closer


def test_attention_weights_are_probabilities_over_the_memory() -> None:
    head, hidden, layout, lexical, rows = _record()
    every_row = torch.arange(hidden.shape[0])
    weights = row_attributions(head, hidden, layout, lexical, every_row, TARGETS, "attention")
    assert (weights >= 0).all()
    # Each layer's attention of one query (or a probability mix of queries) sums to 1 over the memory.
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(len(TARGETS)), rtol=0, atol=1e-5)
    subset = row_attributions(head, hidden, layout, lexical, rows, TARGETS, "attention")
    torch.testing.assert_close(subset, weights[:, rows], rtol=0, atol=1e-7)


def test_a_masked_memory_row_gets_no_attention() -> None:
    head = _randomized_head(8, 1.0, 2.0, 0.5)
    short = _random_record(8, [0, 1], [2, 3])
    long = _random_record(9, [2, 1, 0], [3, 4, 2])
    assert short[0].shape[0] < long[0].shape[0]
    with head.recording_attention() as log:
        head.score_batch(*zip(short, long, strict=True))
    assert {tag for tag, _ in log} == {"evidence", "decoder"}
    for _, probabilities in log:
        # The short record's padding keys (past its own rows) are masked: never attended to.
        assert (probabilities[0, :, :, short[0].shape[0] :] == 0).all()
        assert (probabilities[1] >= 0).all()


@pytest.mark.parametrize("method", ["gradient_x_input", "attention"])
def test_rows_outside_the_explained_ones_are_never_weighed(method: str) -> None:
    """Per-row methods weigh a row the same whichever other rows are explained, in the order given."""
    head, hidden, layout, lexical, rows = _record()
    every_row = torch.arange(hidden.shape[0])
    full = row_attributions(head, hidden, layout, lexical, every_row, TARGETS, method)
    picked = rows.flip(0)[:3]
    some = row_attributions(head, hidden, layout, lexical, picked, TARGETS, method)
    assert some.shape == (len(TARGETS), 3)
    torch.testing.assert_close(some, full[:, picked], rtol=1e-5, atol=1e-6)


def test_integrated_gradients_leave_the_other_rows_real() -> None:
    """Only the explained rows move along the path: the others keep their real memory, so explaining a
    subset is not the same as explaining every row."""
    head, hidden, layout, lexical, rows = _record()
    every_row = torch.arange(hidden.shape[0])
    full = row_attributions(head, hidden, layout, lexical, every_row, TARGETS, "integrated_gradients")
    some = row_attributions(head, hidden, layout, lexical, rows[:2], TARGETS, "integrated_gradients")
    assert some.shape == (len(TARGETS), 2)
    assert not torch.allclose(some, full[:, rows[:2]], atol=1e-6)


def test_an_unknown_method_is_a_value_error() -> None:
    head, hidden, layout, lexical, rows = _record()
    with pytest.raises(ValueError, match="unknown attribution method 'saliency'"):
        row_attributions(head, hidden, layout, lexical, rows, TARGETS, "saliency")


def test_inference_tensors_are_explained() -> None:
    """The engine's hidden rows come from inference mode: attribution must still differentiate."""
    head, hidden, layout, lexical, rows = _record()
    with torch.inference_mode():
        frozen = hidden.clone()
    weights = row_attributions(head, frozen, layout, lexical, rows, TARGETS, "gradient_x_input")
    expected = row_attributions(head, hidden, layout, lexical, rows, TARGETS, "gradient_x_input")
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)


def test_the_hooks_leave_the_scores_unchanged() -> None:
    head, hidden, layout, lexical, _ = _record()
    scores = head.score(hidden, layout, lexical)
    with head.recording_attention() as log:
        recorded = head.score(hidden, layout, lexical)
    assert len(log) == len(head.evidence_layers) + len(head.layers)
    assert torch.equal(recorded, scores)
    with torch.no_grad():
        from_memory = head.logits_from_memory(hidden, layout, lexical, head.memory_rows(hidden))
    assert torch.equal(from_memory, scores)
    # With autograd the memory is built without `out=` blocks: the same numbers up to rounding.
    with torch.enable_grad():
        differentiable = head.logits_from_memory(hidden, layout, lexical, head.memory_rows(hidden))
    torch.testing.assert_close(differentiable.detach(), scores, rtol=0, atol=1e-6)
    head.score(hidden, layout, lexical)
    assert len(log) == len(head.evidence_layers) + len(head.layers)  # recording stopped with the block


def test_target_values_are_log_probabilities_or_the_expected_level() -> None:
    layout = HeadLayout(
        type_ids=[0, 1, 2],
        question_spans=[(0, 1), (1, 2), (2, 3)],
        option_spans=[[(3, 4), (4, 5)], [(5, 6), (6, 7), (7, 8)], [(8, 9), (9, 10), (10, 11)]],
    )
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, 0.0, 1.0, 3.0])
    values = target_values(
        logits, layout, [AttributionTarget(0, 0), AttributionTarget(1, 2), AttributionTarget(2, None)]
    )
    noul = 0.5 - math.log(math.exp(0.5) + math.exp(-1.0))
    choice = 1.0 - math.log(math.exp(2.0) + math.exp(0.0) + math.exp(1.0))
    levels = [math.exp(0.0), math.exp(1.0), math.exp(3.0)]
    score = (levels[1] + 2 * levels[2]) / sum(levels)
    torch.testing.assert_close(values, torch.tensor([noul, choice, score]), rtol=0, atol=1e-6)
