"""The developer tooling's one direction: tests, benchmarks and scripts import `devtools`; `devtools` imports
none of them, and benchmarks and scripts never reach into the tests (read from the source with ``ast``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _top_level_imports(path: Path) -> set[str]:
    """The first component of every absolute module ``path`` imports (any depth: a function-level import
    counts)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _wrong_imports(folder: str, forbidden: set[str]) -> list[tuple[str, str]]:
    return sorted(
        (str(path.relative_to(ROOT)), name)
        for path in (ROOT / folder).rglob("*.py")
        for name in _top_level_imports(path) & forbidden
    )


def test_devtools_imports_no_tests_benchmarks_or_scripts() -> None:
    assert not _wrong_imports("devtools", {"tests", "benchmarks", "scripts"})


def test_benchmarks_and_scripts_never_import_the_tests() -> None:
    assert not _wrong_imports("benchmarks", {"tests"})
    assert not _wrong_imports("scripts", {"tests"})


def test_the_scan_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from tests.server import helpers\n    import benchmarks.suite\n")
    assert _top_level_imports(source) == {"tests", "benchmarks"}
    # And the tools do use each other the intended way (the scan reads real files).
    assert "devtools" in _top_level_imports(ROOT / "benchmarks" / "load_test.py")
