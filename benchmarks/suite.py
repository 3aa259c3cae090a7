"""The performance suite: ``benchmarks/engine_bench.py`` (every section) on the tiny and the medium model,
one fresh process per model, raw JSON and markdown under ``benchmarks/results/``, and optionally that part of
BENCHMARKS.md refreshed in place (between its markers; every other section of the file is kept).

    python benchmarks/suite.py                                # tiny + medium, default mode (~15 min here)
    python benchmarks/suite.py --models medium --full
    python benchmarks/suite.py --update-benchmarks-md         # also rewrite the clef-bench section

Each model writes ``benchmarks/results/bench-<model>.json`` and ``bench-<model>.md``. Not a test: figures
depend on the machine and its load (recorded in every report).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BENCHMARKS_MD = REPO / "BENCHMARKS.md"
BEGIN_MARKER = "<!-- clef-bench:begin (written by benchmarks/suite.py) -->"
END_MARKER = "<!-- clef-bench:end -->"


def run_model(model: str, mode: str) -> Path:
    """Run every ``engine_bench.py`` section on ``model`` in a subprocess; returns the markdown written."""
    json_path = RESULTS / f"bench-{model}.json"
    markdown_path = json_path.with_suffix(".md")
    command = [sys.executable, str(REPO / "benchmarks" / "engine_bench.py"), "--model", model]
    command += [
        "--json",
        str(json_path.relative_to(REPO)),
        "--markdown",
        str(markdown_path.relative_to(REPO)),
    ]
    if mode != "default":
        command.append(f"--{mode}")
    subprocess.run(command, check=True, cwd=REPO)
    return markdown_path


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


def main() -> int:
    """Run the suite; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "medium"])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--full", action="store_true")
    parser.add_argument("--update-benchmarks-md", action="store_true")
    args = parser.parse_args()
    mode = "quick" if args.quick else "full" if args.full else "default"
    RESULTS.mkdir(parents=True, exist_ok=True)
    sections = []
    for model in args.models:
        print(f"== {model} ({mode})", file=sys.stderr, flush=True)
        sections.append(run_model(model, mode).read_text(encoding="utf-8"))
    if args.update_benchmarks_md:
        update_benchmarks_md(sections)
        print(f"updated {BENCHMARKS_MD}", file=sys.stderr)
    else:
        sys.stdout.write("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
