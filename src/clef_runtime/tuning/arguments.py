"""The flags of ``clef tune`` (its engine flags come from ``clef_runtime.cli.add_engine_arguments``).
Standard library only, so building the parser stays fast: `TuneSettings` holds the settings, their
defaults and checks, and generates their flags."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["DEFAULT_LR", "TIERS", "TuneSettings", "TuneSettingsError", "add_tune_arguments"]

#: What each tier trains (see `clef_runtime.tuning.trainer.TIER_PARAMETERS`), cheapest first.
TIERS = ("scalars", "scorer", "full")

#: The learning rate of each tier when --lr is not given: measured on the keyword task of
#: tests/tuning/tasks.py (docs/tuning.md, "Defaults"). Fewer, larger-scale parameters take larger steps.
DEFAULT_LR = {"scalars": 0.05, "scorer": 3e-3, "full": 1e-3}


class TuneSettingsError(ValueError):
    """A ``clef tune`` setting is out of range; the message names its flag."""


def _setting(default: Any, metavar: str | None, help: str, **argument: Any) -> Any:
    """A `TuneSettings` field whose flag takes ``metavar`` and says ``help`` (``argument``: more of
    ``add_argument``'s keywords; ``loss=True`` for the objective's weights, listed last)."""
    return field(default=default, metadata={"metavar": metavar, "help": help, **argument})


@dataclass(frozen=True)
class TuneSettings:
    """``clef tune``'s settings, validated (`TuneSettingsError` names the flag at fault). Immutable. Each
    field is the flag of its name (``--batch-size`` for ``batch_size``); the defaults live here, once, and
    docs/tuning.md says why each is what it is."""

    holdout_fraction: float = _setting(
        0.2, "X", "share of CASES held out when --holdout is not given", type=float
    )
    tier: str = _setting(
        "full",
        None,
        "what to train: the three scalars, + the residual scorer, or the whole head (default full)",
        choices=TIERS,
    )
    epochs: int = _setting(30, "N", "at most N epochs", type=int)
    patience: int = _setting(8, "N", "stop after N epochs without a better holdout NLL", type=int)
    lr: float | None = _setting(
        None,
        "X",
        "AdamW learning rate (default by tier: "
        + ", ".join(f"{tier} {lr:g}" for tier, lr in DEFAULT_LR.items())
        + ")",
        type=float,
    )
    """None: the tier's `DEFAULT_LR` (`learning_rate`)."""
    batch_size: int = _setting(16, "B", "cases per optimiser step", type=int)
    feature_batch_size: int = _setting(8, "B", "cases per backbone call when computing features", type=int)
    seed: int = _setting(0, "S", "split and shuffle seed", type=int)
    label_smoothing: float = _setting(0.05, "X", "cross-entropy's", type=float, loss=True)
    brier_weight: float = _setting(0.5, "W", "weight of the Brier term", type=float, loss=True)
    ordinal_weight: float = _setting(
        0.25, "W", "weight of the ordinal term (score questions only)", type=float, loss=True
    )
    weight_decay: float = _setting(0.0, "X", "AdamW's weight decay", type=float, loss=True)

    def __post_init__(self) -> None:
        checks = [
            (self.tier in TIERS, f"--tier must be one of {', '.join(TIERS)}"),
            (self.epochs >= 1, "--epochs must be at least 1"),
            (self.patience >= 1, "--patience must be at least 1"),
            (self.batch_size >= 1, "--batch-size must be at least 1"),
            (self.feature_batch_size >= 1, "--feature-batch-size must be at least 1"),
            (0 < self.holdout_fraction < 1, "--holdout-fraction must be between 0 and 1"),
            (self.lr is None or (math.isfinite(self.lr) and self.lr > 0), "--lr must be a positive number"),
            (0 <= self.label_smoothing < 1, "--label-smoothing must be in [0, 1)"),
            (self.brier_weight >= 0 and self.ordinal_weight >= 0, "loss weights must be at least 0"),
            (self.weight_decay >= 0, "--weight-decay must be at least 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise TuneSettingsError(message)

    @property
    def learning_rate(self) -> float:
        """``lr``, else the tier's default."""
        return self.lr if self.lr is not None else DEFAULT_LR[self.tier]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TuneSettings:
        """The settings of parsed ``clef tune`` flags. Raises `TuneSettingsError`."""
        return cls(**{item.name: getattr(args, item.name) for item in fields(cls)})


def _add_setting_flags(parser: argparse.ArgumentParser, *, loss: bool) -> None:
    """The flags of the `TuneSettings` fields that are (``loss``) or are not the objective's weights."""
    for item in fields(TuneSettings):
        argument = dict(item.metadata)
        if argument.pop("loss", False) == loss:
            parser.add_argument("--" + item.name.replace("_", "-"), default=item.default, **argument)


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """``clef tune``'s own flags."""
    parser.add_argument("file", metavar="CASES", help="the labelled cases (JSON lines, as clef eval reads)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where to write the tuned head")
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a DIR that already holds a head: the old head, its calibration and report are "
        "first moved to DIR/previous/ (replacing what is there)",
    )
    parser.add_argument(
        "--holdout",
        metavar="F",
        help="held-out cases (a case file) for early stopping and the report; default: a seeded "
        f"--holdout-fraction of CASES ({TuneSettings.holdout_fraction:g})",
    )
    _add_setting_flags(parser, loss=False)
    parser.add_argument(
        "--cache-dir",
        metavar="D",
        help="where the backbone features are kept (default: DIR/features); share it between runs",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="fit temperatures on the holdout afterwards and write DIR/calibration.json",
    )
    _add_setting_flags(parser, loss=True)
