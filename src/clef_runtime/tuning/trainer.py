"""Training a tier of the joint schema head on cached features, with early stopping on the holdout NLL.

Tiers (what requires grad; everything else stays bit for bit the starting head's):

- ``scalars``: ``prior_logit_scale``, ``joint_logit_scale``, ``residual_gate`` (3 numbers: how much the
  lexical prior, the cosine and the residual scorer count);
- ``scorer``: those + ``residual_scorer`` (the MLP over each option's field and row);
- ``full``: the whole head.

For ``scalars`` and ``scorer`` nothing before the residual scorer changes, so the frozen head's
`OptionFeatures` are computed once per run (`JointSchemaHead.option_features`) and an epoch is a few small
matrix products; ``full`` runs the head's forward and backward (`JointSchemaHead.training_logits`) on the
hidden rows every step. Everything is fp32.

Determinism: the starting head is the same, the shuffle comes from a seeded `torch.Generator`, the head has
no dropout in its functional forward, and the loop runs with `torch.use_deterministic_algorithms` (restored
afterwards): the same seed and inputs give bitwise the same weights on one machine and thread count.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from clef_runtime.model.head import JointSchemaHead, OptionFeatures
from clef_runtime.tuning.arguments import TuneSettings
from clef_runtime.tuning.features import RowFeatures
from clef_runtime.tuning.objective import LossWeights, QuestionIndex, question_losses, question_nll
from clef_runtime.tuning.rows import TuneRow

__all__ = [
    "TIER_PARAMETERS",
    "EpochRecord",
    "TrainResult",
    "TuningData",
    "row_logits",
    "settings_report",
    "train_head",
    "trainable_names",
]

#: The parameter names (exact, or a prefix ending in ".") each tier trains.
TIER_PARAMETERS: dict[str, tuple[str, ...]] = {
    "scalars": ("prior_logit_scale", "joint_logit_scale", "residual_gate"),
    "scorer": ("prior_logit_scale", "joint_logit_scale", "residual_gate", "residual_scorer."),
    "full": ("",),
}
#: A holdout NLL must fall by more than this to count as better (summation noise is far below).
MIN_IMPROVEMENT = 1e-6
#: Gradients are clipped to this global norm: one odd batch cannot throw the head far off.
MAX_GRAD_NORM = 1.0
#: Rows per forward when only evaluating (no graph is kept).
EVAL_ROWS = 64


def trainable_names(head: JointSchemaHead, tier: str) -> list[str]:
    """The parameter names ``tier`` trains, in the head's order. Raises ValueError for an unknown tier."""
    if tier not in TIER_PARAMETERS:
        raise ValueError(f"unknown tier {tier!r} (expected one of {', '.join(TIER_PARAMETERS)})")
    patterns = TIER_PARAMETERS[tier]
    return [
        name
        for name, _ in head.named_parameters()
        if any(name == p or ((p == "" or p.endswith(".")) and name.startswith(p)) for p in patterns)
    ]


def settings_report(settings: TuneSettings) -> dict[str, Any]:
    """A run's hyper-parameters for the report (the learning rate resolved by tier)."""
    return {
        "tier": settings.tier,
        "lr": settings.learning_rate,
        "epochs": settings.epochs,
        "patience": settings.patience,
        "batch_size": settings.batch_size,
        "seed": settings.seed,
        "weight_decay": settings.weight_decay,
        "optimizer": "AdamW",
        "max_grad_norm": MAX_GRAD_NORM,
        "loss": {
            "cross_entropy_weight": 1.0,
            "label_smoothing": settings.label_smoothing,
            "brier_weight": settings.brier_weight,
            "ordinal_weight": settings.ordinal_weight,
        },
    }


class TuningData:
    """The scored rows of one side (training or holdout) and what the head reads of them: the hidden-row
    features (tier ``full``) or the frozen head's `OptionFeatures` (the other tiers), on the head's device."""

    def __init__(
        self,
        rows: Sequence[TuneRow],
        features: Sequence[RowFeatures],
        *,
        frozen_head: JointSchemaHead | None,
    ) -> None:
        self.rows = list(rows)
        self.features = list(features)
        self.option_features: list[OptionFeatures] | None = None
        if frozen_head is not None:
            self.option_features = []
            for start in range(0, len(self.features), EVAL_ROWS):
                part = self.features[start : start + EVAL_ROWS]
                self.option_features.extend(
                    frozen_head.option_features(
                        [f.hidden for f in part], [f.layout for f in part], [f.lexical for f in part]
                    )
                )

    def __len__(self) -> int:
        return len(self.rows)


def row_logits(head: JointSchemaHead, data: TuningData, indexes: Sequence[int]) -> Tensor:
    """The concatenated option logits of ``data``'s rows ``indexes`` (in that order), through ``head``; with
    autograd when grad is enabled."""
    if data.option_features is not None:
        return head.option_logits(OptionFeatures.cat([data.option_features[i] for i in indexes]))
    parts = [data.features[i] for i in indexes]
    logits = head.training_logits(
        [p.hidden for p in parts], [p.layout for p in parts], [p.lexical for p in parts]
    )
    return torch.cat(logits)


@dataclass(frozen=True)
class EpochRecord:
    """One point of the curve: the mean training objective over the epoch's steps (epoch 0: of the
    starting head, no step taken) and the holdout NLL after it."""

    epoch: int
    train_loss: float
    holdout_nll: float


@dataclass
class TrainResult:
    """The best head (by holdout NLL; epoch 0 = the starting head, kept when no epoch beat it), its epoch,
    the epochs run, the curve and whether patience ran out before ``epochs``."""

    head: JointSchemaHead
    best_epoch: int
    epochs_run: int
    curve: list[EpochRecord]
    stopped_early: bool
    trained: list[str]


def _batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    order = torch.randperm(count, generator=generator).tolist()
    for start in range(0, count, batch_size):
        yield order[start : start + batch_size]


def _evaluate(head: JointSchemaHead, data: TuningData, weights: LossWeights) -> tuple[float, float]:
    """(mean objective, mean NLL) over ``data``'s scored questions, without grad."""
    losses, nlls = [], []
    with torch.no_grad():
        for start in range(0, len(data), EVAL_ROWS):
            indexes = list(range(start, min(start + EVAL_ROWS, len(data))))
            index = QuestionIndex.build([data.rows[i] for i in indexes], head.device)
            logits = row_logits(head, data, indexes)
            losses.append(question_losses(logits, index, weights))
            nlls.append(question_nll(logits, index))
    return float(torch.cat(losses).double().mean()), float(torch.cat(nlls).double().mean())


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def train_head(
    start: JointSchemaHead,
    train: TuningData,
    holdout: TuningData,
    settings: TuneSettings,
    *,
    progress: Callable[[int], Any] | None = None,
) -> TrainResult:
    """Trains a copy of ``start`` (fp32, on its device) on ``train``'s scored rows for at most
    ``settings.epochs`` epochs, keeping the state with the lowest holdout NLL, and stops after
    ``settings.patience`` epochs without one. ``progress`` is told the rows of every step. ``start`` itself
    is not modified. Raises ValueError for empty data or an unknown tier."""
    if not len(train) or not len(holdout):
        raise ValueError("training needs scored rows on both sides (training and holdout)")
    head = copy.deepcopy(start).to(torch.float32).train(False)
    names = trainable_names(head, settings.tier)
    trainable = set(names)
    parameters = []
    for name, parameter in head.named_parameters():
        parameter.requires_grad_(name in trainable)
        if name in trainable:
            parameters.append(parameter)
    optimizer = torch.optim.AdamW(
        parameters, lr=settings.learning_rate, weight_decay=settings.weight_decay, foreach=False
    )
    generator = torch.Generator().manual_seed(settings.seed)
    weights = LossWeights(settings.label_smoothing, settings.brier_weight, settings.ordinal_weight)

    def snapshot() -> dict[str, Tensor]:
        return {name: p.detach().clone() for name, p in head.named_parameters() if name in trainable}

    with _deterministic():
        train_loss, holdout_nll = _evaluate(head, train, weights)[0], _evaluate(head, holdout, weights)[1]
        curve = [EpochRecord(0, train_loss, holdout_nll)]
        best_nll, best_epoch, best_state = holdout_nll, 0, snapshot()
        waited, epoch = 0, 0
        for epoch in range(1, settings.epochs + 1):
            total, questions = 0.0, 0
            for indexes in _batches(len(train), settings.batch_size, generator):
                index = QuestionIndex.build([train.rows[i] for i in indexes], head.device)
                losses = question_losses(row_logits(head, train, indexes), index, weights)
                loss = losses.mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters, MAX_GRAD_NORM, foreach=False)
                optimizer.step()
                total += float(losses.detach().double().sum())
                questions += index.num_questions
                if progress is not None:
                    progress(len(indexes))
            holdout_nll = _evaluate(head, holdout, weights)[1]
            curve.append(EpochRecord(epoch, total / max(questions, 1), holdout_nll))
            if not math.isfinite(holdout_nll):
                break
            if holdout_nll < best_nll - MIN_IMPROVEMENT:
                best_nll, best_epoch, best_state, waited = holdout_nll, epoch, snapshot(), 0
            else:
                waited += 1
                if waited >= settings.patience:
                    break
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if name in trainable:
                parameter.copy_(best_state[name])
            parameter.requires_grad_(False)
    return TrainResult(
        head=head.eval(),
        best_epoch=best_epoch,
        epochs_run=epoch,
        curve=curve,
        stopped_early=epoch < settings.epochs,
        trained=names,
    )
