"""Every benchmark script answers ``--help`` (in this process: its module imports, its parser builds) and
has a smoke run (``--quick``, or engine_bench's and suite's own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks import load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(
    [path.stem for path in BENCHMARKS.glob("*.py") if path.stem != "__init__"]
    + [path.parent.name for path in BENCHMARKS.glob("*/__main__.py")]
)


def test_the_scripts_are_the_ones_the_library_serves() -> None:
    assert "engine_bench" in SCRIPTS and "bench_server" in SCRIPTS
    assert "server_harness" not in SCRIPTS  # the harness is devtools/harness.py


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_and_a_smoke_run(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = load_benchmark(name)
    with pytest.raises(SystemExit) as exited:
        module.main(["--help"])
    assert exited.value.code == 0
    assert "--quick" in capsys.readouterr().out
