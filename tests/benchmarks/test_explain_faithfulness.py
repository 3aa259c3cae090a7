"""``x_explain``'s default method is faithful on heads tuned with ``clef tune`` on two keyword-decided tasks
(a noul and a three-way choice, classes of equal length): removing its evidence words lowers the answer's
probability more than removing as many random words, keeping only them preserves it better, and the task's
keywords rank in the top k, as rates over the holdout cases whose answer the keywords decide
(benchmarks/explain_faithfulness.py, the same code). Random words as the evidence (the negative control) fail
the same thresholds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from devtools.explain_tasks import MONEY, TEAM, KeywordTask
from devtools.faithfulness import RANDOM, Thresholds

from clef_runtime.engine.clef import Clef
from clef_runtime.options import EXPLAIN_METHODS
from tests.benchmarks import load_benchmark

bench = load_benchmark("explain_faithfulness")

DEFAULT = EXPLAIN_METHODS[0]
#: The benchmark's sizes (benchmarks/explain_faithfulness.py's defaults), so the figures are its figures.
SIZES = {"train": 1200, "holdout": 60, "measured": 60, "top_k": 5, "draws": 5, "seed": 7}
#: docs/explain.md says how they were set: where the random control fails them by a wide margin.
THRESHOLDS = {MONEY.name: Thresholds(), TEAM.name: Thresholds()}


@pytest.fixture(scope="module")
def engine() -> Clef:
    """The tiny model with every engine default: its explanations use the default method."""
    return Clef.load("tiny", dtype="fp32")


def _measure(engine: Clef, task: KeywordTask, directory: Path) -> dict[str, Any]:
    return bench.measure_task({DEFAULT: engine}, task, directory, **SIZES)


@pytest.fixture(scope="module")
def measured(engine: Clef, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each task's rows (the default method's and the random control's)."""
    return {
        task.name: _measure(engine, task, tmp_path_factory.mktemp(task.name))["rows"]
        for task in (MONEY, TEAM)
    }


@pytest.mark.parametrize("task", [MONEY.name, TEAM.name])
def test_the_default_method_passes_every_threshold(measured: dict[str, dict[str, Any]], task: str) -> None:
    row = measured[task][DEFAULT]
    assert row["accuracy"] >= 0.9, row  # a head that learned the task: else nothing is faithful to it
    assert THRESHOLDS[task].failures(row) == [], row


@pytest.mark.parametrize("task", [MONEY.name, TEAM.name])
def test_random_evidence_fails_the_same_thresholds(measured: dict[str, dict[str, Any]], task: str) -> None:
    row = measured[task][RANDOM]
    failures = THRESHOLDS[task].failures(row)
    assert "keyword_recall" in failures and "comprehensiveness_win" in failures, row
