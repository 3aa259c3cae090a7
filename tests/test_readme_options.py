"""README.md's option table is the one generated from the options objects: an option cannot be added,
renamed or re-described without its documentation following."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _options_table_script():  # scripts/ is not a package: load the file itself
    spec = importlib.util.spec_from_file_location("options_table", REPO / "scripts" / "options_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_lists_every_serve_option_as_the_code_defines_it() -> None:
    script = _options_table_script()
    documented = script.readme_table((REPO / "README.md").read_text(encoding="utf-8"))
    assert documented is not None, "README.md lost its options block"
    assert documented == script.table(), "run: python scripts/options_table.py --write"


def test_the_table_has_a_row_per_option_with_its_flag_and_variable() -> None:
    from clef_runtime.serve_command import ALL_SERVE_OPTIONS

    rows = _options_table_script().table().splitlines()[2:]
    assert len(rows) == len(ALL_SERVE_OPTIONS)
    for option, row in zip(ALL_SERVE_OPTIONS, rows, strict=True):
        assert f"`{option.flag}" in row and f"`{option.env}`" in row
