"""The performance suite: ``benchmarks.engine_bench`` (every section) on the tiny and the hidden-1,024
benchmark model, one fresh process per model, raw JSON and markdown under ``benchmarks/results/``, and
optionally that part of BENCHMARKS.md refreshed in place (between its markers; every other section of the
file is kept).

    python -m benchmarks.suite                                # tiny + medium-1024, default mode
    python -m benchmarks.suite --models medium-1024 --full
    python -m benchmarks.suite --quick --results /tmp/suite   # smoke run (seconds on tiny)
    python -m benchmarks.suite --update-benchmarks-md         # also rewrite the clef-bench section

Each model writes ``bench-<model>.json`` and ``bench-<model>.md`` (into ``--results``, else new
time-stamped files in ``benchmarks/results/``). Not a test: figures depend on
the machine and its load (recorded in every report).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from devtools.results import REPO, default_output

BENCHMARKS_MD = REPO / "BENCHMARKS.md"
BEGIN_MARKER = "<!-- clef-bench:begin (written by benchmarks/suite.py) -->"
END_MARKER = "<!-- clef-bench:end -->"


def run_engine_bench(
    model: str, mode: str, json_path: Path, *, sections: Sequence[str] | None = None
) -> Path:
    """Run ``benchmarks.engine_bench`` on ``model`` in a fresh process (clean peak RSS, no allocator state
    carried over), writing ``json_path`` and the markdown beside it; returns the markdown's path. Raises
    CalledProcessError when the run fails."""
    markdown_path = json_path.with_suffix(".md")
    command = [sys.executable, "-m", "benchmarks.engine_bench", "--model", model]
    command += ["--json", _shown(json_path), "--markdown", _shown(markdown_path)]
    if sections:
        command += ["--sections", *sections]
    if mode != "default":
        command.append(f"--{mode}")
    subprocess.run(command, check=True, cwd=REPO)
    return markdown_path


def _shown(path: Path) -> str:
    """A path relative to the repository where it lies inside it (the reports record the command line)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(resolved)


def update_benchmarks_md(sections: list[str]) -> None:
    """Replace the text between the clef-bench markers of BENCHMARKS.md with the per-model tables
    (appending the markers when absent); everything outside the markers, including the hand-written
    summary above them, is left as it is."""
    body = "\n".join([BEGIN_MARKER, "", *sections, END_MARKER])
    text = BENCHMARKS_MD.read_text(encoding="utf-8") if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    if BEGIN_MARKER in text and END_MARKER in text:
        before, rest = text.split(BEGIN_MARKER, 1)
        after = rest.split(END_MARKER, 1)[1]
        text = before + body + after
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    BENCHMARKS_MD.write_text(text, encoding="utf-8")


def add_mode_arguments(parser: argparse.ArgumentParser, models: Sequence[str]) -> None:
    """``--models`` and the ``--quick`` / ``--full`` switch shared with ``bench_model.py``."""
    parser.add_argument("--models", nargs="+", default=list(models))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="engine_bench's smoke plan")
    size.add_argument("--full", action="store_true", help="engine_bench's full plan (16k-token requests)")


def mode_of(args: argparse.Namespace) -> str:
    return "quick" if args.quick else "full" if args.full else "default"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite; returns the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_mode_arguments(parser, ["tiny", "medium-1024"])
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="write bench-<model>.{json,md} into this directory "
        "(default: new time-stamped files in benchmarks/results/)",
    )
    parser.add_argument("--update-benchmarks-md", action="store_true")
    args = parser.parse_args(argv)
    mode = mode_of(args)
    sections = []
    for model in args.models:
        print(f"== {model} ({mode})", file=sys.stderr, flush=True)
        target = args.results / f"bench-{model}.json" if args.results else default_output(f"bench-{model}")
        markdown = run_engine_bench(model, mode, target)
        sections.append(markdown.read_text(encoding="utf-8"))
    if args.update_benchmarks_md:
        update_benchmarks_md(sections)
        print(f"updated {BENCHMARKS_MD}", file=sys.stderr)
    else:
        sys.stdout.write("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
