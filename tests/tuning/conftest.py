"""Fixtures of the tuning tests: the keyword task's case files (tests/tuning/tasks.py), one `clef tune` run
with every default through the command line (shared by the tests that read what it wrote), and helpers that
tune the session's tiny model in process."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clef_runtime.cli import build_parser, main
from clef_runtime.evaluation.cases import load_cases
from clef_runtime.tuning.arguments import TuneSettings
from clef_runtime.tuning.command import REPORT_FILE, TuneJob, tune
from tests.tuning.tasks import write_task_files


@dataclass(frozen=True)
class CliRun:
    """One ``clef tune`` run: its exit status, what it printed and where it wrote."""

    status: int
    stdout: str
    stderr: str
    out: Path

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.out / REPORT_FILE).read_text(encoding="utf-8"))


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``clef ARGV`` in process: (exit status, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        status = main(list(argv))
    return status, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="session")
def billing_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(training file, holdout file) of the keyword task."""
    return write_task_files(tmp_path_factory.mktemp("billing"))


@pytest.fixture(scope="session")
def default_run(billing_files: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    """``clef tune train.jsonl --holdout holdout.jsonl --out DIR`` with every other setting at its default
    (the tiny model, fp32 as every test)."""
    train, holdout = billing_files
    out = tmp_path_factory.mktemp("tuned") / "head"
    status, stdout, stderr = run_cli("tune", str(train), "--holdout", str(holdout), "--out", str(out))
    return CliRun(status, stdout, stderr, out)


def cli_settings(*flags: str) -> TuneSettings:
    """The settings ``clef tune`` would use with ``flags`` (defaults otherwise)."""
    args = build_parser().parse_args(["tune", "cases.jsonl", "--out", "unused", *flags])
    return TuneSettings.from_args(args)


def tune_in_process(
    clef: Any,
    train: Path,
    out: Path,
    *flags: str,
    holdout: Path | None = None,
    cache_dir: Path | None = None,
    calibrate: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Tunes ``clef`` (a loaded tiny model) in process with the settings of ``flags``; returns the report."""
    job = TuneJob(
        cases=load_cases(train),
        cases_path=str(train),
        out=out,
        settings=cli_settings(*flags),
        holdout=load_cases(holdout) if holdout is not None else None,
        holdout_path=str(holdout) if holdout is not None else None,
        cache_dir=cache_dir,
        calibrate=calibrate,
        show_progress=False,
        force=force,
    )
    return tune(clef, job)
