"""Print the tables of the `clef serve` options and of the `clef batch` options (flag, variable, meaning) from
the options objects, or with ``--write`` put them into README.md between their markers.
``tests/test_readme_options.py`` checks that the README's tables are these, so an option cannot be added
without its documentation."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from clef_runtime.batch.command import BATCH_TABLE_OPTIONS
from clef_runtime.options import Option, option_table_markdown
from clef_runtime.serve_command import ALL_SERVE_OPTIONS

README = Path(__file__).resolve().parents[1] / "README.md"
TABLES: dict[str, tuple[Option, ...]] = {"options": ALL_SERVE_OPTIONS, "batch-options": BATCH_TABLE_OPTIONS}
"""Each README block's name and the options it lists."""


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin (scripts/options_table.py --write) -->", f"<!-- {name}:end -->"


def _block(name: str) -> re.Pattern[str]:
    begin, end = markers(name)
    return re.compile(re.escape(begin) + r"\n(.*?)\n" + re.escape(end), re.DOTALL)


def table(name: str = "options") -> str:
    return option_table_markdown(TABLES[name])


def readme_table(text: str, name: str = "options") -> str | None:
    """The table between the README's markers of block ``name``, or None when the markers are missing."""
    match = _block(name).search(text)
    return match.group(1) if match else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="replace the README's tables")
    args = parser.parse_args()
    if not args.write:
        for name in TABLES:
            print(f"{name}:\n{table(name)}\n")
        return 0
    text = README.read_text(encoding="utf-8")
    for name in TABLES:
        if readme_table(text, name) is None:
            print(f"README.md has no {' ... '.join(markers(name))} block", file=sys.stderr)
            return 2
        begin, end = markers(name)
        text = _block(name).sub(lambda _, b=begin, e=end, n=name: f"{b}\n{table(n)}\n{e}", text)
    README.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
