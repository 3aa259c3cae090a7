"""A results file's frame: the exact command that produced it, when, on what machine, and how long it took.

Every benchmark starts its report with `start_report` (which measures the machine record, GEMM limits
included, in this process) and ends it with `finish_report`; `write_json` writes it. New runs write new
files: the committed ``benchmarks/results/*.json`` are records of what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools.gemm import QUICK_SHAPES, STANDARD_SHAPES
from devtools.machine import load_average, machine_record

__all__ = [
    "FORMAT",
    "RESULTS",
    "command_line",
    "default_output",
    "finish_report",
    "start_report",
    "write_json",
]

REPO = Path(__file__).resolve().parents[1]
#: Where results files go (the committed ones are records: a run never overwrites them by default).
RESULTS = REPO / "benchmarks" / "results"

#: The layout of the report frame (2: machine record with multi-shape GEMM limits, command, spread).
FORMAT = 2


def command_line(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run: ``python -m <module> ARGV`` for a script (a ``.py`` file, or a
    package's folder) inside the repository, ``python <script>`` for one outside it (``argv``: the arguments
    given, default ``sys.argv[1:]``), quoted for a POSIX shell."""
    path = Path(script).resolve()
    arguments = list(sys.argv[1:] if argv is None else argv)
    if not path.is_relative_to(REPO):
        return shlex.join(["python", str(path), *arguments])
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return shlex.join(["python", "-m", module, *arguments])


def default_output(stem: str, suffix: str = ".json") -> Path:
    """A new results file for this run: ``benchmarks/results/<stem>-<UTC date and time><suffix>``."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return RESULTS / f"{stem}-{stamp}{suffix}"


def start_report(
    benchmark: str,
    script: str | Path,
    argv: Sequence[str] | None = None,
    *,
    command: str | None = None,
    quick: bool = False,
    **machine_arguments: Any,
) -> dict[str, Any]:
    """``{"benchmark", "format", "command", "started_at", "machine"}``: the command that reproduces the run
    (`command_line` of ``script`` and ``argv``, unless ``command`` is given) and the machine record measured
    now (``machine_arguments``: device and GEMM shapes, see `machine_record`; the GEMM shapes default to the
    standard ones, or the small ones for a ``quick`` smoke run). The report keeps the start time for
    `finish_report`."""
    machine_arguments.setdefault("gemm_shapes", QUICK_SHAPES if quick else STANDARD_SHAPES)
    return {
        "benchmark": benchmark,
        "format": FORMAT,
        "command": command if command is not None else command_line(script, argv),
        "started_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "_started": time.perf_counter(),
        "machine": machine_record(**machine_arguments),
    }


def finish_report(report: dict[str, Any]) -> dict[str, Any]:
    """Add ``wall_s`` (since `start_report`) and the load average at the end; returns the report."""
    started = report.pop("_started", None)
    if started is not None:
        report["wall_s"] = round(time.perf_counter() - started, 1)
    report["load_average_end"] = load_average()
    return report


def write_json(path: Path | str, report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON (creating the directory). Raises OSError."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def save(report: dict[str, Any], path: Path | None, stem: str) -> Path:
    """`finish_report` and write the report to ``path``, or to a new `default_output` file named after
    ``stem``; returns the path written. Raises OSError."""
    finish_report(report)
    target = path or default_output(stem)
    write_json(target, report)
    return target


def publish(report: dict[str, Any], path: Path | str | None) -> int:
    """`finish_report`, write the report to ``path`` (when given) and print it; returns exit status 0."""
    finish_report(report)
    if path is not None:
        write_json(path, report)
    print(json.dumps(report, indent=2))
    return 0


def add_run_arguments(
    parser: argparse.ArgumentParser, *, quick: str, output: str = "--json", model: str | None = None
) -> None:
    """The flags every benchmark has: ``--quick`` (its smoke run, described by ``quick``), the results
    file (``output``: the script's historical flag name), and ``--model`` with its default where the script
    takes one (a benchmark model name, "tiny" or a checkpoint directory)."""
    if model is not None:
        parser.add_argument(
            "--model",
            default=model,
            help=f"a benchmark model name, 'tiny' or a checkpoint directory ({model})",
        )
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    parser.add_argument(output, type=Path, default=None, help="write the results (JSON) here")
