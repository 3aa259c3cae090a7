"""The ``clef tune`` command: cases -> features (cached) -> a trained head tier -> DIR.

DIR receives ``joint_head.safetensors`` + ``joint_head_config.json`` (the release layout: ``--head DIR``
serves it), ``tune_report.json``, ``calibration.json`` with ``--calibrate`` and, unless ``--cache-dir`` says
otherwise, the feature cache ``features/``; every file mode 0644. A DIR that already holds a head is refused
before any model work unless ``--force``, which moves that head, its calibration and report to
``DIR/previous/`` (replacing an older one there) just before the new head is written: a run that fails or is
interrupted leaves DIR's head as it was.

Exit status: 0 done; 1 the model could not be loaded or a file could not be read or written; 2 bad usage
(a bad flag or value, invalid case lines, every one listed, cases the engine refuses, no scorable case,
``--out`` naming a file or a directory holding a head without ``--force``); 130 interrupted (Ctrl-C), with
what the feature cache kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clef_runtime.engine.calibration import Calibration
from clef_runtime.engine.preparer import PreparedRequest
from clef_runtime.evaluation.calibrate import fit_calibration
from clef_runtime.evaluation.cases import Case, CaseFileError, CaseFileUnusable, load_cases
from clef_runtime.evaluation.metrics import Outcome
from clef_runtime.evaluation.runner import progress_bar
from clef_runtime.options import MODEL_OPTION, EngineOptions, read_option_values
from clef_runtime.protocol.errors import ClefError
from clef_runtime.release import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE
from clef_runtime.tuning.arguments import TuneSettings, TuneSettingsError
from clef_runtime.tuning.features import (
    FILE_MODE,
    FeatureStats,
    FeatureStore,
    RowFeatures,
    compute_features,
    model_fingerprint,
    row_key,
)
from clef_runtime.tuning.report import build_report, head_outcomes, text_summary
from clef_runtime.tuning.rows import RowProblem, TuneRow, prepare_rows
from clef_runtime.tuning.trainer import TuningData, settings_report, train_head

__all__ = [
    "CALIBRATION_FILE",
    "PREVIOUS_DIR",
    "REPORT_FILE",
    "TuneError",
    "TuneJob",
    "check_out",
    "run_tune",
    "separable_types",
    "tune",
]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
#: The shell's status for a run ended by SIGINT (128 + 2), as `clef_runtime.cli.main` returns it.
EXIT_INTERRUPTED = 130
REPORT_FILE = "tune_report.json"
#: What the engine loads from a head directory (`clef_runtime.engine.heads.HEAD_CALIBRATION_FILE`).
CALIBRATION_FILE = "calibration.json"
FEATURES_DIR = "features"
#: Where ``--force`` keeps the head it replaces, inside DIR.
PREVIOUS_DIR = "previous"
#: Any one of these in DIR means DIR holds a head (a calibration alone belongs to a head that was there).
HEAD_FILES = (HEAD_WEIGHTS_FILE, HEAD_CONFIG_FILE, CALIBRATION_FILE)
#: What ``--force`` moves to DIR/previous/: the head and the files that describe it.
PREVIOUS_FILES = (*HEAD_FILES, REPORT_FILE)


class TuneError(Exception):
    """Tuning cannot go on: ``status`` is the exit status, ``lines`` what to print before the error line."""

    def __init__(self, message: str, status: int, lines: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.lines = list(lines)


@dataclass(frozen=True)
class TuneJob:
    """One tuning run: the cases, where the holdout comes from, where things go and the settings."""

    cases: list[Case]
    cases_path: str
    out: Path
    settings: TuneSettings = field(default_factory=TuneSettings)
    holdout: list[Case] | None = None
    holdout_path: str | None = None
    cache_dir: Path | None = None
    calibrate: bool = False
    show_progress: bool = True
    force: bool = False


def _problem_lines(path: str, problems: Sequence[RowProblem]) -> list[str]:
    return [f"{path}:{p.line}: case {p.case_id}: {p.message}" for p in problems]


def _split(
    rows: list[TuneRow], holdout_rows: list[TuneRow] | None, fraction: float, seed: int
) -> tuple[list[TuneRow], list[TuneRow], str]:
    """(training rows, holdout rows, where the holdout came from): only rows with a scored question."""
    scored = [row for row in rows if row.scored]
    if holdout_rows is not None:
        return scored, [row for row in holdout_rows if row.scored], "file"
    cases = sorted({row.case_index for row in scored})
    if len(cases) < 2:
        raise TuneError(
            "a holdout split needs at least 2 cases with expected answers (or give --holdout)", EXIT_USAGE
        )
    count = min(len(cases) - 1, max(1, round(fraction * len(cases))))
    order = np.random.default_rng(seed).permutation(len(cases))
    held = {cases[i] for i in order[:count]}
    return (
        [row for row in scored if row.case_index not in held],
        [row for row in scored if row.case_index in held],
        f"{count} of {len(cases)} cases, seed {seed}",
    )


def _features(store: FeatureStore, rows: Sequence[TuneRow]) -> list[RowFeatures]:
    found = []
    for row in rows:
        features = store.read(row.key, row.layout)
        if features is None:
            raise TuneError(f"cannot read the features of case {row.case_id} at {store.path(row.key)}", 1)
        found.append(features)
    return found


def _write_json(path: Path, data: Any) -> None:
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    staged.chmod(FILE_MODE)
    staged.replace(path)


def _head_files(out: Path) -> list[str]:
    return [name for name in HEAD_FILES if (out / name).exists()]


def check_out(out: Path, force: bool) -> None:
    """Refuses an ``--out`` that is a file, or that holds a head unless ``force``: cheap, so it runs before
    the model loads. Raises TuneError (usage)."""
    if out.exists() and not out.is_dir():
        raise TuneError(f"--out {out} is a file: name a directory (it is created if needed)", EXIT_USAGE)
    found = _head_files(out) if out.is_dir() else []
    if found and not force:
        raise TuneError(
            f"--out {out} already holds a head ({', '.join(found)}): pass --force to replace it (it is "
            f"moved to {out / PREVIOUS_DIR}) or choose another directory",
            EXIT_USAGE,
        )


def _keep_previous(out: Path) -> Path | None:
    """Moves the head in ``out`` (and its calibration and report) to ``out/previous/``, replacing what an
    earlier ``--force`` left there; the files are gathered in a staging folder first so that a failure leaves
    either the old or the new ``previous/``, whole. Returns where they went, None when there was no head.
    Raises OSError."""
    if not _head_files(out):
        return None
    previous = out / PREVIOUS_DIR
    staging = out / f".{PREVIOUS_DIR}.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    for name in PREVIOUS_FILES:
        if (out / name).exists():
            (out / name).replace(staging / name)
    if previous.exists():
        shutil.rmtree(previous)
    staging.replace(previous)
    return previous


def _starting_head(clef: Any) -> str | None:
    """The directory of the starting head, None for the release's own head (`clef_runtime.engine.heads`)."""
    default = clef.heads.default
    return None if default.source == "release" else str(default.path)


def _interrupted(store: FeatureStore, rows: Sequence[TuneRow], out: Path) -> TuneError:
    """What to say when Ctrl-C stops a run before DIR is written: how much of the feature pass is kept."""
    layouts = {row.key: row.layout for row in rows}
    kept = sum(store.has(key, layout) for key, layout in layouts.items())
    return TuneError(
        f"{kept} of {len(layouts)} rows' features are cached in {store.directory}; no head, report or "
        f"calibration was written to --out {out}; run the same command again to continue",
        EXIT_INTERRUPTED,
    )


def _feature_pass(
    clef: Any,
    job: TuneJob,
    store: FeatureStore,
    rows: Sequence[TuneRow],
    prepared: dict[str, PreparedRequest],
) -> FeatureStats:
    """Makes sure the features of ``rows`` are in ``store`` (`compute_features`), with a progress bar."""
    bar = progress_bar(len({row.key for row in rows}), "tune features") if job.show_progress else None
    try:
        return compute_features(
            clef,
            rows,
            prepared,
            store,
            batch_size=job.settings.feature_batch_size,
            progress=bar.update if bar is not None else None,
        )
    except ClefError as error:
        raise TuneError(f"the backbone refused a case: {error.message}", EXIT_FAILURE) from None
    finally:
        if bar is not None:
            bar.close()


def tune(clef: Any, job: TuneJob) -> dict[str, Any]:
    """Runs one tuning job with a loaded `Clef` (its default head is the starting head) and writes DIR.
    Returns the report. Raises `TuneError` (with its exit status; `EXIT_INTERRUPTED` for Ctrl-C before DIR
    is written) and OSError for files."""
    check_out(job.out, job.force)
    started = time.perf_counter()
    fingerprint = model_fingerprint(clef)
    rows, prepared, problems = prepare_rows(clef.prepare, job.cases, lambda p: row_key(fingerprint, p))
    lines = _problem_lines(job.cases_path, problems)
    holdout_rows = None
    if job.holdout is not None:
        holdout_rows, held_prepared, held_problems = prepare_rows(
            clef.prepare, job.holdout, lambda p: row_key(fingerprint, p)
        )
        lines += _problem_lines(str(job.holdout_path), held_problems)
        prepared.update(held_prepared)
    if lines:
        raise TuneError(f"{len(lines)} case(s) the engine cannot take", EXIT_USAGE, lines)
    train_rows, held_rows, holdout_source = _split(
        rows, holdout_rows, job.settings.holdout_fraction, job.settings.seed
    )
    if not train_rows:
        raise TuneError(
            f"no case of {job.cases_path} is left to train on with an expected answer", EXIT_USAGE
        )
    if not held_rows:
        raise TuneError("no held-out case has an expected answer", EXIT_USAGE)

    store = FeatureStore(job.cache_dir or job.out / FEATURES_DIR)
    needed = train_rows + held_rows
    start_head = clef.head
    frozen = None if job.settings.tier == "full" else start_head
    try:  # nothing is written to DIR before training ends, but for the feature cache
        stats = _feature_pass(clef, job, store, needed, prepared)
        features_s = time.perf_counter() - started
        train = TuningData(train_rows, _features(store, train_rows), frozen_head=frozen)
        holdout = TuningData(held_rows, _features(store, held_rows), frozen_head=frozen)
        training_started = time.perf_counter()
        bar = progress_bar(job.settings.epochs * len(train), "tune") if job.show_progress else None
        try:
            result = train_head(
                start_head,
                train,
                holdout,
                job.settings,
                progress=bar.update if bar is not None else None,
            )
        finally:
            if bar is not None:
                bar.close()
        training_s = time.perf_counter() - training_started
    except KeyboardInterrupt:
        raise _interrupted(store, needed, job.out) from None

    before, after = head_outcomes(start_head, holdout), head_outcomes(result.head, holdout)
    job.out.mkdir(parents=True, exist_ok=True)
    previous = _keep_previous(job.out) if job.force else None
    result.head.save_files(job.out)
    for name in (HEAD_WEIGHTS_FILE, HEAD_CONFIG_FILE):  # `save_files` leaves them at the umask's mode
        (job.out / name).chmod(FILE_MODE)
    calibration_path = job.out / CALIBRATION_FILE
    calibration = None
    if job.calibrate:
        _, document = fit_calibration(
            after,
            fitted_on={
                "cases": len({row.case_index for row in held_rows}),
                "model": clef.name,
                "file": Path(job.holdout_path).name
                if job.holdout_path
                else f"holdout of {Path(job.cases_path).name}",
                "head": "clef tune",
            },
        )
        _write_json(calibration_path, document)
        Calibration.load(calibration_path)  # what the engine will read: fail here, not when serving
        separable = separable_types(after)
        calibration = {
            "file": CALIBRATION_FILE,
            "temperatures": document["temperatures"],
            "questions": document["questions"],
            "nll_before": document["nll_before"],
            "nll_after": document["nll_after"],
            "note": "fitted on the holdout that also chose the epoch: its NLL gain is optimistic",
            "no_wrong_answer": separable,
        }
        if separable:
            print(
                f"clef tune: warning: the tuned head answers every held-out {', '.join(separable)} question "
                "right, so the fit can only sharpen its temperature towards the bound: its probabilities "
                "will be near 0 or 1 on unseen cases too; give a larger --holdout, or drop --calibrate",
                file=sys.stderr,
            )

    counts = {
        "train_cases": len({row.case_index for row in train_rows}),
        "holdout_cases": len({row.case_index for row in held_rows}),
        "train_rows": len(train_rows),
        "holdout_rows": len(held_rows),
        "train_questions": sum(q.target is not None for row in train_rows for q in row.questions),
        "holdout_questions": len(after),
        "unscored_cases": len(
            {row.case_index for row in rows} - {row.case_index for row in rows if row.scored}
        ),
        "holdout_source": holdout_source,
        "cases_file": Path(job.cases_path).name,
        "holdout_file": Path(job.holdout_path).name if job.holdout_path else None,
    }
    report = build_report(
        model=clef.name,
        result=result,
        settings={
            **settings_report(job.settings),
            "feature_batch_size": job.settings.feature_batch_size,
        },
        before=before,
        after=after,
        counts=counts,
        features={"computed": stats.computed, "cached": stats.cached, "cache_dir": str(store.directory)},
        seconds={
            "features": round(features_s, 3),
            "training": round(training_s, 3),
            "total": round(time.perf_counter() - started, 3),
        },
        calibration=calibration,
        seed=job.settings.seed,
        starting_head=_starting_head(clef),
        previous=str(previous) if previous is not None else None,
    )
    _write_json(job.out / REPORT_FILE, report)
    return report


def separable_types(outcomes: Sequence[Outcome]) -> list[str]:
    """The question types whose scored outcomes are all right: temperature scaling's NLL then falls as T
    falls, so the fitted T says nothing about unseen cases."""
    by_type: dict[str, list[bool]] = {}
    for outcome in outcomes:
        if outcome.expected is not None:
            by_type.setdefault(outcome.question_type, []).append(outcome.predicted == outcome.expected)
    return sorted(kind for kind, right in by_type.items() if all(right))


def _fail(message: str, status: int) -> int:
    print(f"clef tune: error: {message}", file=sys.stderr)
    return status


def _load_cases(path: str) -> list[Case]:
    try:
        return load_cases(path)
    except CaseFileUnusable as error:
        raise TuneError(error.message, EXIT_USAGE) from None
    except CaseFileError as error:
        raise TuneError(
            f"{len(error.problems)} invalid line(s) in {path}", EXIT_USAGE, error.lines()
        ) from None


def _load_engine(args: argparse.Namespace, options: EngineOptions) -> Any:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.load_errors import LoadFailure, classify_load_error

    model = read_option_values(args, os.environ, [MODEL_OPTION]).get("model", "tiny")
    try:
        return Clef.load(model, options)
    except Exception as error:
        # A bad option goes on to the usage error; a bug keeps its traceback.
        if classify_load_error(error) is not LoadFailure.UNLOADABLE:
            raise
        raise TuneError(f"cannot load {model!r}: {error}", EXIT_FAILURE) from None


def _has_expected(cases: Sequence[Case]) -> bool:
    return any(case.expected for case in cases)


def run_tune(args: argparse.Namespace) -> int:
    """``clef tune``. Returns the exit status."""
    try:
        try:
            settings = TuneSettings.from_args(args)
        except TuneSettingsError as error:
            raise TuneError(str(error), EXIT_USAGE) from None
        out = Path(args.out)
        check_out(out, args.force)
        if args.cache_dir and Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():
            raise TuneError(f"--cache-dir {args.cache_dir} is a file", EXIT_USAGE)
        options = EngineOptions.from_sources(args, os.environ)
        if options.calibration:
            raise TuneError(
                "a head is tuned on raw probabilities: drop --calibration / CLEF_CALIBRATION "
                "(--calibrate fits one for the tuned head)",
                EXIT_USAGE,
            )
        cases = _load_cases(args.file)
        holdout = _load_cases(args.holdout) if args.holdout else None
        if not _has_expected(cases):
            raise TuneError(f"no case of {args.file} has an expected answer: nothing to learn", EXIT_USAGE)
        if holdout is not None and not _has_expected(holdout):
            raise TuneError(f"no case of {args.holdout} has an expected answer", EXIT_USAGE)
        clef = _load_engine(args, options)
        job = TuneJob(
            cases=cases,
            cases_path=args.file,
            out=out,
            settings=settings,
            holdout=holdout,
            holdout_path=args.holdout,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            calibrate=args.calibrate,
            force=args.force,
        )
        report = tune(clef, job)
    except KeyboardInterrupt:  # before the cases were prepared: nothing was computed or written
        print("clef tune: interrupted: nothing was computed or written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except TuneError as error:
        for line in error.lines:
            print(line, file=sys.stderr)
        if error.status == EXIT_INTERRUPTED:
            print(f"clef tune: interrupted: {error.message}", file=sys.stderr)
            return error.status
        return _fail(error.message, error.status)
    except OSError as error:
        where = f" {error.filename}" if error.filename else ""
        return _fail(f"cannot read or write{where}: {error.strerror or error}", EXIT_FAILURE)
    print(text_summary(report, str(out)))
    return EXIT_OK
