"""The ``clef eval``, ``clef calibrate`` and ``clef compare`` commands (after argument parsing).

Exit status: 0 done; 1 the model could not be loaded, the server could not be used, or some cases could
not be answered (each listed on stderr; the metrics cover the rest); 2 bad usage: invalid case lines (every
one listed with its line number), a bad option or calibration file, nothing to score.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from clef_runtime.evaluation.cases import Case, CaseFileError, CaseFileUnusable, load_cases
from clef_runtime.evaluation.runner import (
    RemoteError,
    RunResult,
    answer_in_process,
    answer_url,
    calibrated_outcomes,
    progress_bar,
)
from clef_runtime.options import (
    ENGINE_OPTIONS,
    MODEL_OPTION,
    EngineOptions,
    parse_head_specs,
    read_option_values,
)

__all__ = ["run_calibrate", "run_compare", "run_eval"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
#: A holdout NLL this much above the uncalibrated one counts as worse (float summation noise is ~1e-15).
NLL_NOISE = 1e-9


class _Stop(Exception):
    """Stop the command with this exit status (the message is already printed)."""

    def __init__(self, status: int) -> None:
        self.status = status


def _fail(command: str, message: str, status: int) -> _Stop:
    print(f"clef {command}: error: {message}", file=sys.stderr)
    return _Stop(status)


def _command(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The entry point of a command: ``run``'s exit status, or the one a `_Stop` it raised carries."""

    @functools.wraps(run)
    def entry(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except _Stop as stop:
            return stop.status

    return entry


def _cases(command: str, path: str) -> list[Case]:
    try:
        return load_cases(path)
    except CaseFileUnusable as exc:
        raise _fail(command, exc.message, EXIT_USAGE) from None
    except CaseFileError as exc:
        for line in exc.lines():
            print(line, file=sys.stderr)
        raise _fail(command, f"{len(exc.problems)} invalid line(s) in {path}", EXIT_USAGE) from None


def _load_engine(command: str, model: str, options: EngineOptions) -> Any:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.load_errors import LoadFailure, classify_load_error

    try:
        clef = Clef.load(model, options)
    except Exception as exc:
        # A bad option goes on to the usage error; a bug keeps its traceback.
        if classify_load_error(exc) is not LoadFailure.UNLOADABLE:
            raise
        raise _fail(command, f"cannot load {model!r}: {exc}", EXIT_FAILURE) from None
    return clef  # Clef.load itself warns (once) when the model is untrained


def _engine_flags_given(args: argparse.Namespace) -> list[str]:
    return [o.flag for o in (MODEL_OPTION, *ENGINE_OPTIONS) if getattr(args, o.field, None) is not None]


def _engine_from_args(command: str, args: argparse.Namespace, options: EngineOptions) -> Any:
    model = read_option_values(args, os.environ, [MODEL_OPTION]).get("model", "tiny")
    return _load_engine(command, model, options)


def _answer(clef: Any, cases: Sequence[Case], batch_size: int, label: str) -> RunResult:
    bar = progress_bar(len(cases), label)
    try:
        return answer_in_process(clef, cases, batch_size=batch_size, progress=bar)
    finally:
        bar.close()


def _report_failures(command: str, path: str, result: RunResult) -> None:
    for case, message in result.failures:
        print(f"{path}:{case.line}: case {case.id}: not answered: {message}", file=sys.stderr)
    if result.failures:
        print(f"clef {command}: {len(result.failures)} case(s) not answered", file=sys.stderr)


def _summarize(command: str, result: RunResult) -> dict[str, Any]:
    from clef_runtime.evaluation.metrics import summarize

    try:
        return summarize(result.outcomes, result.latencies_ms)
    except ValueError as exc:
        raise _fail(command, str(exc), EXIT_USAGE) from None


def _write_json(path: str, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@_command
def run_eval(args: argparse.Namespace) -> int:
    """``clef eval``. Returns the exit status."""
    if args.batch_size < 1 or args.concurrency < 1:
        raise _fail("eval", "--batch-size and --concurrency must be at least 1", EXIT_USAGE)
    if args.url is None and args.api_key is not None:
        raise _fail("eval", "--api-key goes with --url", EXIT_USAGE)
    if args.url is not None and _engine_flags_given(args):
        flags = ", ".join(_engine_flags_given(args))
        raise _fail("eval", f"--url cannot be combined with {flags} (the server has its own)", EXIT_USAGE)
    options = None if args.url else EngineOptions.from_sources(args, os.environ)
    if options is not None and options.calibration:
        from clef_runtime.engine.calibration import Calibration

        Calibration.load(options.calibration)  # a bad file is a usage error before the model loads
    cases = _cases("eval", args.file)
    if args.url is not None:
        bar = progress_bar(len(cases), "eval")
        try:
            result = answer_url(
                args.url, cases, api_key=args.api_key, concurrency=args.concurrency, progress=bar
            )
        except RemoteError as exc:
            raise _fail("eval", str(exc), EXIT_FAILURE) from None
        finally:
            bar.close()
    else:
        assert options is not None
        result = _answer(_engine_from_args("eval", args, options), cases, args.batch_size, "eval")
    _report_failures("eval", args.file, result)
    summary = _summarize("eval", result)
    from clef_runtime.evaluation.report import text_summary, write_report

    print(text_summary(summary, result.source))
    if args.json:
        _write_json(
            args.json,
            {
                **summary,
                "source": result.source,
                "cases": len(cases),
                "failures": [{"line": c.line, "id": c.id, "error": m} for c, m in result.failures],
            },
        )
    if args.report:
        page = write_report(summary, result.source, Path(args.report))
        print(f"report: {page}", file=sys.stderr)
    return EXIT_FAILURE if result.failures else EXIT_OK


def _brief(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The headline metrics of ``overall`` and each type, without the bin and coverage tables."""
    keep = ("n", "accuracy", "brier", "nll", "ece", "mce", "macro_f1", "mae")
    groups = {"overall": summary["overall"], **summary["by_type"]}
    return {name: {k: metrics[k] for k in keep if k in metrics} for name, metrics in groups.items()}


@_command
def run_calibrate(args: argparse.Namespace) -> int:
    """``clef calibrate``. Returns the exit status."""
    from clef_runtime.engine.heads import HEAD_CALIBRATION_FILE
    from clef_runtime.evaluation.calibrate import TEMPERATURE_BOUNDS, fit_calibration
    from clef_runtime.evaluation.metrics import summarize

    if args.batch_size < 1:
        raise _fail("calibrate", "--batch-size must be at least 1", EXIT_USAGE)
    options = EngineOptions.from_sources(args, os.environ)
    if options.calibration:
        raise _fail(
            "calibrate",
            "temperatures are fitted on the model's raw probabilities: drop --calibration / CLEF_CALIBRATION",
            EXIT_USAGE,
        )
    for spec in parse_head_specs(options.head):
        own = spec.path / HEAD_CALIBRATION_FILE
        if spec.name is None and own.exists():
            raise _fail(
                "calibrate",
                f"--head {spec.path} carries its own {HEAD_CALIBRATION_FILE}, which the engine applies: "
                "temperatures are fitted on raw probabilities, so move it away first (--out may replace it)",
                EXIT_USAGE,
            )
    cases = _cases("calibrate", args.file)
    holdout = _cases("calibrate", args.holdout) if args.holdout else None
    clef = _engine_from_args("calibrate", args, options)
    result = _answer(clef, cases, args.batch_size, "calibrate")
    _report_failures("calibrate", args.file, result)
    try:
        calibration, document = fit_calibration(
            result.outcomes,
            fitted_on={
                "cases": len(result.answered),
                "model": result.source["model"],
                "file": Path(args.file).name,
            },
        )
    except ValueError as exc:
        raise _fail("calibrate", str(exc), EXIT_USAGE) from None
    if holdout is not None:
        held = _answer(clef, holdout, args.batch_size, "holdout")
        _report_failures("calibrate", args.holdout, held)
        before = _summarize("calibrate", held)
        after = summarize(calibrated_outcomes(held.outcomes, calibration.apply))
        document["holdout"] = {
            "file": Path(args.holdout).name,
            "cases": len(held.answered),
            "before": _brief(before),
            "after": _brief(after),
            # The fit lowers the NLL of the cases it saw by construction; on unseen ones it can raise it.
            "nll_worse": after["overall"]["nll"] > before["overall"]["nll"] + NLL_NOISE,
        }
    _write_json(args.out, document)
    print(f"wrote {args.out}")
    print("temperatures: " + ", ".join(f"{k} {v:.4f}" for k, v in document["temperatures"].items()))
    for name, value in [*document["temperatures"].items(), *document["questions"].items()]:
        if any(abs(value - bound) < 1e-6 for bound in TEMPERATURE_BOUNDS):
            print(
                f"note: {name}'s temperature is at the bound {value:g} of {TEMPERATURE_BOUNDS}: the fit "
                "wanted more; check that this set is large and labelled right",
                file=sys.stderr,
            )
    for qid, value in document["questions"].items():
        print(f"  question {qid}: {value:.4f}")
    print(f"nll on {args.file}: {document['nll_before']:.4f} -> {document['nll_after']:.4f}")
    if holdout is not None:
        print(f"holdout {args.holdout} (before -> after):")
        after = document["holdout"]["after"]
        for name, b in document["holdout"]["before"].items():
            cells = ", ".join(
                f"{k} {b[k]:.4f} -> {after[name][k]:.4f}" for k in ("nll", "brier", "ece", "accuracy")
            )
            print(f"  {name} (n={b['n']}): {cells}")
        if document["holdout"]["nll_worse"]:
            _warn_worse_holdout(args, document["holdout"])
    return EXIT_FAILURE if result.failures else EXIT_OK


def _warn_worse_holdout(args: argparse.Namespace, holdout: dict[str, Any]) -> None:
    before, after = holdout["before"]["overall"]["nll"], holdout["after"]["overall"]["nll"]
    print(
        f"warning: the calibration makes the holdout NLL worse ({before:.4f} -> {after:.4f} on "
        f"{args.holdout}): the temperatures fitted on {args.file} do not carry over to cases the fit did not "
        "see (too few cases, or sets labelled differently); check before serving it",
        file=sys.stderr,
    )


def _run_side(side: Any, cases: Sequence[Case], args: argparse.Namespace, name: str) -> RunResult:
    if side.url is None:
        clef = _load_engine("compare", side.model, side.options)
        result = _answer(clef, cases, args.batch_size, f"compare {name}")
        del clef  # one model in memory at a time
        gc.collect()
        return result
    bar = progress_bar(len(cases), f"compare {name}")
    try:
        return answer_url(side.url, cases, api_key=side.api_key, concurrency=args.concurrency, progress=bar)
    except RemoteError as exc:
        raise _fail("compare", f"--{name}: {exc}", EXIT_FAILURE) from None
    finally:
        bar.close()


@_command
def run_compare(args: argparse.Namespace) -> int:
    """``clef compare``. Returns the exit status."""
    from clef_runtime.evaluation.compare import compare_results, parse_side

    if args.batch_size < 1 or args.concurrency < 1:
        raise _fail("compare", "--batch-size and --concurrency must be at least 1", EXIT_USAGE)
    sides = {"a": parse_side(args.a, "--a"), "b": parse_side(args.b, "--b")}
    for side in sides.values():
        if side.options is not None and side.options.calibration:
            from clef_runtime.engine.calibration import Calibration

            Calibration.load(side.options.calibration)  # fail before any model loads
    cases = _cases("compare", args.file)
    results = {name: _run_side(side, cases, args, name) for name, side in sides.items()}
    for result in results.values():
        _report_failures("compare", args.file, result)
    try:
        drift = compare_results(results["a"], results["b"])
    except ValueError as exc:
        raise _fail("compare", str(exc), EXIT_FAILURE) from None
    print(f"a: {args.a}\nb: {args.b}")
    if drift["rounded"]:
        print("note: a URL side's probabilities are rounded to 4 decimals on the wire (|dp| floor 0.00005)")
    print(
        f"questions {drift['questions']}: max |dp| {drift['max_abs_dp']:.6g}, "
        f"mean |dp| {drift['mean_abs_dp']:.6g}, top-1 agreement {drift['top1_agreement']:.4f}, "
        f"flips {len(drift['flips'])}"
    )
    for kind, part in drift["by_type"].items():
        print(
            f"  {kind} ({part['questions']}): max |dp| {part['max_abs_dp']:.6g}, mean |dp| "
            f"{part['mean_abs_dp']:.6g}, top-1 agreement {part['top1_agreement']:.4f}"
        )
    for flip in drift["flips"][: args.flips]:
        print(
            f"  flip case {flip['case']} {flip['question']}: a {flip['a']} (p {flip['a_p']:.4f}, margin "
            f"{flip['a_margin']:.4f}) vs b {flip['b']} (p {flip['b_p']:.4f}, margin {flip['b_margin']:.4f})"
        )
    if args.json:
        described = {name: side.describe() for name, side in sides.items()}
        _write_json(
            args.json,
            {
                **drift,
                "a": described["a"] | {"source": results["a"].source},
                "b": described["b"] | {"source": results["b"].source},
            },
        )
    failed = results["a"].failures or results["b"].failures
    return EXIT_FAILURE if failed else EXIT_OK
