"""The tuning objective, per scored question over its own options (docs/tuning.md, "Loss"):

- label-smoothed cross-entropy: ``-sum_k q_k ln p_k`` with ``q = (1 - e) onehot + e / K`` (e = 0.05 by
  default: the head's release softmax is sharp, and a few hundred cases would otherwise push it sharper);
- + ``brier_weight`` x the Brier score ``sum_k (p_k - onehot_k)^2`` (the metric `clef eval` reports; bounded,
  so one mislabelled case cannot dominate a batch);
- + ``ordinal_weight`` x, for score questions only, the expected distance to the right level
  ``sum_k p_k |k - y| / (K - 1)`` (cross-entropy treats "one level off" like "four levels off").

Questions without an expected answer are not scored. The loss of a batch is the mean over its scored
questions. `QuestionIndex` gathers a batch's concatenated option logits into a padded [Q, K] matrix once, so
every term is one vectorised expression.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from clef_runtime.evaluation.metrics import NLL_FLOOR
from clef_runtime.tuning.rows import TuneRow

__all__ = ["LossWeights", "QuestionIndex", "question_losses", "question_nll"]


@dataclass(frozen=True)
class LossWeights:
    """The objective's settings (see the module docstring)."""

    label_smoothing: float = 0.05
    brier_weight: float = 0.5
    ordinal_weight: float = 0.25

    def __post_init__(self) -> None:
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.brier_weight < 0 or self.ordinal_weight < 0:
            raise ValueError("loss weights must be at least 0")


@dataclass(frozen=True)
class QuestionIndex:
    """Where the scored questions of a batch of rows are in its concatenated [O] logits: ``positions``
    [Q, K] (option positions, -1 pads), ``targets`` [Q] (the expected option's column), ``counts`` [Q]
    (options per question) and ``is_score`` [Q]."""

    positions: Tensor
    targets: Tensor
    counts: Tensor
    is_score: Tensor

    @classmethod
    def build(cls, rows: Sequence[TuneRow], device: torch.device | str = "cpu") -> QuestionIndex:
        """The index of ``rows``' scored questions, for logits concatenated in row order."""
        positions: list[list[int]] = []
        targets: list[int] = []
        is_score: list[bool] = []
        offset = 0
        for row in rows:
            for question, count in zip(row.questions, row.layout.option_counts, strict=True):
                if question.target is not None:
                    positions.append(list(range(offset, offset + count)))
                    targets.append(question.target)
                    is_score.append(question.question_type == "score")
                offset += count
        width = max((len(p) for p in positions), default=1)
        padded = [p + [-1] * (width - len(p)) for p in positions]
        return cls(
            positions=torch.tensor(padded, dtype=torch.long, device=device).view(-1, width),
            targets=torch.tensor(targets, dtype=torch.long, device=device),
            counts=torch.tensor([len(p) for p in positions], dtype=torch.long, device=device),
            is_score=torch.tensor(is_score, dtype=torch.bool, device=device),
        )

    @property
    def num_questions(self) -> int:
        """Scored questions in the batch."""
        return int(self.targets.shape[0])

    def log_probs(self, logits: Tensor) -> Tensor:
        """Per-question log-softmax over its own options, [Q, K] (-inf in the pads)."""
        pads = self.positions < 0
        gathered = logits[self.positions.clamp(min=0)].masked_fill(pads, -math.inf)
        return torch.log_softmax(gathered, dim=-1)


def question_losses(logits: Tensor, index: QuestionIndex, weights: LossWeights) -> Tensor:
    """The objective of each scored question, [Q] (differentiable in ``logits``)."""
    log_probs = index.log_probs(logits)
    real = index.positions >= 0
    safe_logs = log_probs.masked_fill(~real, 0.0)
    probs = safe_logs.exp().masked_fill(~real, 0.0)
    rows = torch.arange(index.num_questions, device=logits.device)
    picked = safe_logs[rows, index.targets]
    counts = index.counts.to(logits.dtype)
    smoothing = weights.label_smoothing
    loss = -(1 - smoothing) * picked - smoothing * safe_logs.sum(-1) / counts
    if weights.brier_weight:
        onehot = torch.zeros_like(probs)
        onehot[rows, index.targets] = 1.0
        loss = loss + weights.brier_weight * ((probs - onehot) ** 2).sum(-1)
    if weights.ordinal_weight and bool(index.is_score.any()):
        levels = torch.arange(probs.shape[1], device=logits.device, dtype=logits.dtype)
        distance = (levels[None, :] - index.targets[:, None].to(logits.dtype)).abs()
        expected_distance = (probs * distance).sum(-1) / (counts - 1).clamp(min=1)
        loss = loss + weights.ordinal_weight * torch.where(index.is_score, expected_distance, 0.0)
    return loss


def question_nll(logits: Tensor, index: QuestionIndex) -> Tensor:
    """``-ln p(expected)`` of each scored question, [Q], with p floored at `NLL_FLOOR` as `clef eval`'s NLL
    metric (no smoothing: what early stopping and the report measure)."""
    log_probs = index.log_probs(logits)
    rows = torch.arange(index.num_questions, device=logits.device)
    return -log_probs[rows, index.targets].clamp(min=math.log(NLL_FLOOR))
