"""The flags of ``clef tune`` (its engine flags come from ``clef_runtime.cli.add_engine_arguments``).
Standard library only, so building the parser stays fast; the defaults live here, once, and docs/tuning.md
says why each is what it is."""

from __future__ import annotations

import argparse

__all__ = ["DEFAULTS", "DEFAULT_LR", "TIERS", "add_tune_arguments"]

#: What each tier trains (see `clef_runtime.tuning.trainer.TIER_PARAMETERS`), cheapest first.
TIERS = ("scalars", "scorer", "full")

#: The learning rate of each tier when --lr is not given: measured on the keyword task of
#: tests/tuning/tasks.py (docs/tuning.md, "Defaults"). Fewer, larger-scale parameters take larger steps.
DEFAULT_LR = {"scalars": 0.05, "scorer": 3e-3, "full": 1e-3}

DEFAULTS = {
    "tier": "full",
    "epochs": 30,
    "patience": 8,
    "batch_size": 16,
    "feature_batch_size": 8,
    "seed": 0,
    "holdout_fraction": 0.2,
    "label_smoothing": 0.05,
    "brier_weight": 0.5,
    "ordinal_weight": 0.25,
    "weight_decay": 0.0,
}


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """``clef tune``'s own flags."""
    d = DEFAULTS
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
        f"--holdout-fraction of CASES ({d['holdout_fraction']:g})",
    )
    parser.add_argument(
        "--holdout-fraction",
        type=float,
        default=d["holdout_fraction"],
        metavar="X",
        help="share of CASES held out when --holdout is not given",
    )
    parser.add_argument(
        "--tier",
        choices=TIERS,
        default=d["tier"],
        help="what to train: the three scalars, + the residual scorer, or the whole head "
        f"(default {d['tier']})",
    )
    parser.add_argument("--epochs", type=int, default=d["epochs"], metavar="N", help="at most N epochs")
    parser.add_argument(
        "--patience",
        type=int,
        default=d["patience"],
        metavar="N",
        help="stop after N epochs without a better holdout NLL",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        metavar="X",
        help="AdamW learning rate (default by tier: "
        + ", ".join(f"{tier} {lr:g}" for tier, lr in DEFAULT_LR.items())
        + ")",
    )
    parser.add_argument(
        "--batch-size", type=int, default=d["batch_size"], metavar="B", help="cases per optimiser step"
    )
    parser.add_argument(
        "--feature-batch-size",
        type=int,
        default=d["feature_batch_size"],
        metavar="B",
        help="cases per backbone call when computing features",
    )
    parser.add_argument("--seed", type=int, default=d["seed"], metavar="S", help="split and shuffle seed")
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
    parser.add_argument(
        "--label-smoothing", type=float, default=d["label_smoothing"], metavar="X", help="cross-entropy's"
    )
    parser.add_argument(
        "--brier-weight", type=float, default=d["brier_weight"], metavar="W", help="weight of the Brier term"
    )
    parser.add_argument(
        "--ordinal-weight",
        type=float,
        default=d["ordinal_weight"],
        metavar="W",
        help="weight of the ordinal term (score questions only)",
    )
    parser.add_argument(
        "--weight-decay", type=float, default=d["weight_decay"], metavar="X", help="AdamW's weight decay"
    )
