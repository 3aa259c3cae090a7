"""README.md's option table is the one generated from the options objects: an option cannot be added,
renamed or re-described without its documentation following."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _options_table_script():  # scripts/ is not a package: load the file itself
    spec = importlib.util.spec_from_file_location("options_table", REPO / "scripts" / "options_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["options", "batch-options"])
def test_the_readme_lists_every_option_as_the_code_defines_it(name: str) -> None:
    script = _options_table_script()
    documented = script.readme_table((REPO / "README.md").read_text(encoding="utf-8"), name)
    assert documented is not None, f"README.md lost its {name} block"
    assert documented == script.table(name), "run: python scripts/options_table.py --write"


def test_the_table_has_a_row_per_option_with_its_flag_and_variable() -> None:
    from clef_runtime.serve_command import ALL_SERVE_OPTIONS

    rows = _options_table_script().table().splitlines()[2:]
    assert len(rows) == len(ALL_SERVE_OPTIONS)
    for option, row in zip(ALL_SERVE_OPTIONS, rows, strict=True):
        assert f"`{option.flag}" in row and f"`{option.env}`" in row


def test_the_batch_table_lists_the_batch_and_pool_options() -> None:
    from clef_runtime.batch.command import BATCH_OPTIONS

    rows = _options_table_script().table("batch-options")
    for option in BATCH_OPTIONS:
        assert f"`{option.flag}" in rows and f"`{option.env}`" in rows
    for flag in ("--replicas", "--ray-num-cpus", "--ray-num-gpus"):
        assert f"`{flag}" in rows
