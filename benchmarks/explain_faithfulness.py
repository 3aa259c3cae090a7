"""How faithful ``x_explain``'s evidence is, per attribution method, on heads tuned on keyword-decided tasks.

For each task of `devtools.explain_tasks` (``money``: a noul, ``team``: a three-way choice; every class the
same length, so only the inserted keywords decide the label): a head is tuned on the tiny model with the real
``clef tune`` code path and every default (fp32), then served by name in one engine per method
(``--explain-method``); every holdout case is decided with ``x_explain {"top_k": k, "granularity": "word"}``
and its evidence measured as `devtools.faithfulness` says: ERASER comprehensiveness and sufficiency against
random word sets of the same size (win rates and means), and the known-word recall@k. The row ``random``
(k random words as the evidence) is the negative control.

Run: ``python -m benchmarks.explain_faithfulness [--train 600] [--holdout 60] [--top-k 5] [--draws 5]
[--json OUT]``; ``--quick`` is a smoke run (a few cases, one draw: its figures mean nothing). The markdown
table goes to stdout; the raw JSON to ``--json`` or a new ``benchmarks/results/explain-faithfulness-*.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from devtools.explain_tasks import TASKS, KeywordTask
from devtools.faithfulness import RANDOM, explain_cases, random_evidence, score_method, tune_task
from devtools.results import add_run_arguments, save, start_report

from clef_runtime.options import EXPLAIN_METHODS

#: The smoke run's sizes: plumbing only (a head tuned on 40 cases explains nothing faithfully).
QUICK = {"train": 40, "holdout": 4, "draws": 1}


def measure_task(
    clefs: Mapping[str, Any],
    task: KeywordTask,
    directory: Path,
    *,
    train: int,
    holdout: int,
    measured: int | None = None,
    top_k: int,
    draws: int,
    seed: int,
) -> dict[str, Any]:
    """One task: a head tuned with the first engine of ``clefs`` (method name -> loaded tiny engine with
    that ``explain_method``), served by every engine as the task's name; each method's figures and the
    random control's (`devtools.faithfulness.score_method`), scored by the first engine, on the first
    ``measured`` holdout cases (all by default: fewer measure the same head faster)."""
    scorer = next(iter(clefs.values()))
    cases = task.cases(holdout, 2, "h")[:measured]
    started = time.perf_counter()
    report = tune_task(scorer, task, directory, train, holdout)
    tuning = {
        "train_cases": train,
        "holdout_cases": holdout,
        "measured_cases": len(cases),
        "seconds": round(time.perf_counter() - started, 1),
        "holdout_accuracy": report.get("holdout", {}).get("after", {}).get("overall", {}).get("accuracy"),
    }
    for clef in clefs.values():
        clef.load_head(task.name, str(directory / "head"))
    rows: dict[str, Any] = {}
    decided = {method: explain_cases(clef, task.name, task, cases, top_k) for method, clef in clefs.items()}
    for method, evidence in decided.items():
        rows[method] = score_method(scorer, task.name, task, evidence, draws=draws, seed=seed)
    # The control keeps the first engine's answers (every engine answers alike) with random words as evidence.
    control = random_evidence(next(iter(decided.values())), top_k, seed + 1)
    rows[RANDOM] = score_method(scorer, task.name, task, control, draws=draws, seed=seed)
    return {"question": dict(task.question), "mentions": task.mentions, "tuning": tuning, "rows": rows}


def _figure(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def markdown(report: Mapping[str, Any]) -> str:
    """The table: one line per task and method (rates on the rationale cases, every case's in brackets)."""
    lines = [
        f"top_k = {report['top_k']}, word granularity, {report['draws']} random sets per case; "
        "win: strictly better than the random sets' mean; rates on the rationale cases (answered with their "
        "own keyword-bearing label), every case's in brackets",
        "",
        "| task | method | holdout acc. | rationale cases | comp. win | suff. win | comp. (random) "
        "| suff. (random) | keyword recall@k |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, task in report["tasks"].items():
        for method, row in task["rows"].items():
            lines.append(
                f"| {name} | {method} | {_figure(row['accuracy'])} | {row['rationale_cases']} "
                f"| {_figure(row['comprehensiveness_win'])} ({_figure(row['comprehensiveness_win_all'])}) "
                f"| {_figure(row['sufficiency_win'])} ({_figure(row['sufficiency_win_all'])}) "
                f"| {_figure(row['comprehensiveness'], 3)} ({_figure(row['comprehensiveness_random'], 3)}) "
                f"| {_figure(row['sufficiency'], 3)} ({_figure(row['sufficiency_random'], 3)}) "
                f"| {_figure(row['keyword_recall'])} |"
            )
    return "\n".join(lines)


def _engines(methods: Sequence[str]) -> dict[str, Any]:
    from clef_runtime.engine.clef import Clef

    return {method: Clef.load("tiny", dtype="fp32", explain_method=method) for method in methods}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS), help="tasks to run")
    parser.add_argument(
        "--methods", nargs="+", choices=EXPLAIN_METHODS, default=list(EXPLAIN_METHODS), help="methods"
    )
    parser.add_argument("--train", type=int, default=1200, help="training cases per task (1200)")
    parser.add_argument("--holdout", type=int, default=60, help="holdout cases measured per task (60)")
    parser.add_argument("--top-k", type=int, default=5, help="evidence words per answer (5)")
    parser.add_argument("--draws", type=int, default=5, help="random word sets per case (5)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the random word sets (7)")
    add_run_arguments(parser, quick="40 training cases, 4 holdout cases, 1 random set per case")
    args = parser.parse_args(argv)
    if args.quick:
        args.train, args.holdout, args.draws = QUICK["train"], QUICK["holdout"], QUICK["draws"]
    report: dict[str, Any] = {
        **start_report("explain_faithfulness", __file__, argv, quick=args.quick),
        "top_k": args.top_k,
        "draws": args.draws,
        "tasks": {},
    }
    clefs = _engines(args.methods)
    with tempfile.TemporaryDirectory(prefix="clef-faithfulness-") as work:
        for name in args.tasks:
            directory = Path(work) / name
            directory.mkdir()
            report["tasks"][name] = measure_task(
                clefs,
                TASKS[name],
                directory,
                train=args.train,
                holdout=args.holdout,
                top_k=args.top_k,
                draws=args.draws,
                seed=args.seed,
            )
    path = save(report, args.json, "explain-faithfulness")
    print(markdown(report))
    print(f"\nraw results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
