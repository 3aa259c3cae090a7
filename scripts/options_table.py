"""Print the table of every `clef serve` option (flag, variable, meaning) from the options object, or with
``--write`` put it into README.md between its markers. ``tests/test_readme_options.py`` checks that the
README's table is this one, so an option cannot be added without its documentation."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from clef_runtime.options import option_table_markdown
from clef_runtime.serve_command import ALL_SERVE_OPTIONS

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- options:begin (scripts/options_table.py --write) -->", "<!-- options:end -->"
BLOCK = re.compile(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), re.DOTALL)


def table() -> str:
    return option_table_markdown(ALL_SERVE_OPTIONS)


def readme_table(text: str) -> str | None:
    """The table between the README's markers, or None when the markers are missing."""
    match = BLOCK.search(text)
    return match.group(1) if match else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="replace the README's table")
    args = parser.parse_args()
    if not args.write:
        print(table())
        return 0
    text = README.read_text(encoding="utf-8")
    if readme_table(text) is None:
        print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 2
    README.write_text(BLOCK.sub(lambda _: f"{BEGIN}\n{table()}\n{END}", text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
