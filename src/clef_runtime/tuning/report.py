"""What a tuning run measured: held-out outcomes of a head, the before/after metrics (`clef eval`'s
definitions, `clef_runtime.evaluation.metrics`), the paired tests of the change and the short text printed
at the end. ``tune_report.json`` is the `build_report` object (docs/tuning.md, "The report")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from clef_runtime.evaluation.metrics import NLL_FLOOR, Outcome, summarize
from clef_runtime.model.head import JointSchemaHead
from clef_runtime.tuning.statistics import mcnemar_exact, paired_bootstrap, sign_test, wilcoxon_signed_rank
from clef_runtime.tuning.trainer import EVAL_ROWS, TrainResult, TuningData, row_logits

__all__ = [
    "REPORT_VERSION",
    "build_report",
    "head_outcomes",
    "metrics_brief",
    "paired_tests",
    "starting_head_name",
    "text_summary",
]

REPORT_VERSION = 1
BRIEF_KEYS = ("n", "accuracy", "nll", "ece", "brier", "mce", "macro_f1", "mae")


def head_outcomes(head: JointSchemaHead, data: TuningData) -> list[Outcome]:
    """Every scored question of ``data`` as an `Outcome` of ``head`` (probabilities in answer order, as
    `clef eval` builds them from a served answer: noul ``[p, 1 - p]``)."""
    outcomes: list[Outcome] = []
    with torch.no_grad():
        for start in range(0, len(data), EVAL_ROWS):
            indexes = list(range(start, min(start + EVAL_ROWS, len(data))))
            logits = row_logits(head, data, indexes).to("cpu", torch.float64)
            offset = 0
            for i in indexes:
                row = data.rows[i]
                for question, count in zip(row.questions, row.layout.option_counts, strict=True):
                    part = logits[offset : offset + count]
                    offset += count
                    if question.target is None:
                        continue
                    probs = part.softmax(-1).numpy()
                    ordered = probs[question.answer_order]
                    if question.question_type == "noul":
                        ordered = np.array([ordered[0], 1.0 - ordered[0]])
                    outcomes.append(
                        Outcome(
                            case_id=row.case_id,
                            question_id=question.question_id,
                            question_type=question.question_type,
                            options=question.answer_options,
                            probs=ordered,
                            expected=question.answer_order.index(question.target),
                        )
                    )
    return outcomes


def metrics_brief(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """``overall`` and ``by_type`` headline metrics (accuracy, NLL, ECE, Brier, ...), without the bin and
    coverage tables. Raises ValueError when nothing is scored."""
    summary = summarize(outcomes)
    groups = {"overall": summary["overall"], **summary["by_type"]}
    brief = {name: {k: m[k] for k in BRIEF_KEYS if k in m} for name, m in groups.items()}
    return {"overall": brief.pop("overall"), "by_type": brief}


def _nll(outcome: Outcome) -> float:
    assert outcome.expected is not None
    return -float(np.log(max(float(outcome.probs[outcome.expected]), NLL_FLOOR)))


def paired_tests(before: Sequence[Outcome], after: Sequence[Outcome], *, seed: int) -> dict[str, Any]:
    """The paired tests of ``after`` against ``before`` (the same questions in the same order): McNemar on
    correctness; sign, Wilcoxon and a case-clustered bootstrap on per-question NLL (after - before)."""
    pairs = list(zip(before, after, strict=True))
    for a, b in pairs:
        if (a.case_id, a.question_id) != (b.case_id, b.question_id):
            raise ValueError("paired_tests: before and after are not the same questions")
    differences = [_nll(b) - _nll(a) for a, b in pairs]
    return {
        "questions": len(pairs),
        "accuracy": mcnemar_exact(
            [a.predicted == a.expected for a, _ in pairs], [b.predicted == b.expected for _, b in pairs]
        ),
        "nll": {
            "mean_difference": float(np.mean(differences)),
            "sign": sign_test(differences),
            "wilcoxon": wilcoxon_signed_rank(differences),
            "bootstrap": paired_bootstrap(differences, [a.case_id for a, _ in pairs], seed=seed),
        },
    }


def build_report(
    *,
    model: str,
    result: TrainResult,
    settings: dict[str, Any],
    before: Sequence[Outcome],
    after: Sequence[Outcome],
    counts: dict[str, Any],
    features: dict[str, Any],
    seconds: dict[str, float],
    calibration: dict[str, Any] | None,
    seed: int,
    starting_head: str | None = None,
    previous: str | None = None,
) -> dict[str, Any]:
    """The ``tune_report.json`` object. ``starting_head``: the directory of the head tuning started from
    (None: the release's own); ``previous``: where ``--force`` moved the head DIR held (None: none)."""
    return {
        "version": REPORT_VERSION,
        "model": model,
        "starting_head": starting_head,
        "previous_head": previous,
        "settings": settings,
        "trained_parameters": result.trained,
        "cases": counts,
        "features": features,
        "epochs_run": result.epochs_run,
        "best_epoch": result.best_epoch,
        "stopped_early": result.stopped_early,
        "curve": [
            {"epoch": r.epoch, "train_loss": r.train_loss, "holdout_nll": r.holdout_nll} for r in result.curve
        ],
        "holdout": {"before": metrics_brief(before), "after": metrics_brief(after)},
        "paired_tests": paired_tests(before, after, seed=seed),
        "calibration": calibration,
        "seconds": seconds,
    }


def _p(value: float) -> str:
    return f"{value:.2g}" if value < 0.01 else f"{value:.3f}"


def text_summary(report: dict[str, Any], out: str) -> str:
    """The lines ``clef tune`` prints at the end."""
    before, after = report["holdout"]["before"]["overall"], report["holdout"]["after"]["overall"]
    tests = report["paired_tests"]
    settings = report["settings"]
    cases = report["cases"]
    lines = [
        f"tuned {report['model']} ({settings['tier']} tier, lr {settings['lr']:g}, "
        f"batch {settings['batch_size']}, seed {settings['seed']}) on {cases['train_rows']} rows, "
        f"held out {cases['holdout_rows']} ({cases['holdout_source']})",
        f"epochs {report['epochs_run']} (best {report['best_epoch']}"
        + (", stopped early" if report["stopped_early"] else "")
        + f"); features: {report['features']['computed']} computed, {report['features']['cached']} cached",
        f"holdout ({before['n']} questions)   before -> after",
    ]
    for key in ("accuracy", "nll", "ece", "brier"):
        lines.append(f"  {key:<9} {before[key]:.4f} -> {after[key]:.4f}")
    nll = tests["nll"]
    boot = nll["bootstrap"]
    lines.append(
        f"paired: McNemar p {_p(tests['accuracy']['p_value'])} ({tests['accuracy']['only_after']} fixed, "
        f"{tests['accuracy']['only_before']} broken); NLL change {nll['mean_difference']:+.4f} "
        f"[{boot['low']:+.4f}, {boot['high']:+.4f}] (95% bootstrap), sign p {_p(nll['sign']['p_value'])}, "
        f"Wilcoxon p {_p(nll['wilcoxon']['p_value'])}"
    )
    if report["best_epoch"] == 0:
        lines.append(
            f"note: no epoch beat the starting head ({starting_head_name(report)}) on the holdout NLL: "
            "the head written is the starting head, unchanged"
        )
    if report["calibration"] is not None:
        temperatures = report["calibration"]["temperatures"]
        lines.append("calibration: " + ", ".join(f"{k} {v:.3f}" for k, v in temperatures.items()))
    if report.get("previous_head"):
        lines.append(
            f"moved the head {out} held (with its calibration and report) to {report['previous_head']}/"
        )
    lines.append(f"wrote {out}")
    return "\n".join(lines)


def starting_head_name(report: dict[str, Any]) -> str:
    """What the head tuning started from was, in words: the release's or a ``--head DIR``."""
    where = report.get("starting_head")
    return f"the head in {where}" if where else f"the release head of {report['model']}"
