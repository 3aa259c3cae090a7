"""The Makefile sets up .venv on a fresh machine: it says what it installs, shows pip's progress, installs
torch's CPU build at the version pyproject.toml pins, and `make run` installs only what serving needs while
`make test` adds the development tools (`make -n` prints the commands; nothing is installed here)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from tests.conftest import LONG_FILES_FIRST, pytest_collection_modifyitems

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _make_n(*args: str) -> list[str]:
    """The commands ``make -n ARGS`` would run, as a user would see them from a plain shell (under `make
    test` the parent make's variables would turn this one into a sub-make that prints Entering/Leaving
    directory lines)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines()


def _installs(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line and "--upgrade pip" not in line]


def _pinned_torch() -> str:
    """The Makefile's TORCH_VERSION, checked to lie in pyproject.toml's torch range."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    pin = re.search(r"^TORCH_VERSION := (\S+)$", makefile, re.MULTILINE)
    assert pin is not None, "the Makefile does not pin torch"
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    bounds = re.search(r'"torch>=([0-9.]+),<([0-9.]+)"', pyproject)
    assert bounds is not None, "pyproject.toml has no torch range"

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split("."))

    assert version(bounds.group(1)) <= version(pin.group(1)) < version(bounds.group(2)), (pin, bounds)
    return pin.group(1)


def test_the_install_steps_are_announced_and_not_silenced() -> None:
    lines = _make_n("-B", "run")  # -B: as on a fresh machine, nothing built yet
    steps = [line for line in lines if line.startswith('echo "==> [')]
    assert len(steps) == 4, lines
    installs = _installs(lines)
    assert installs and all("--quiet" not in line and "-q " not in line for line in installs), installs
    assert lines[-1].endswith("--port 8094") and "serving" in lines[-2]


def test_torch_is_the_cpu_build_at_the_pinned_version() -> None:
    # PyPI's Linux wheel of torch==X is the CUDA build; PyTorch's CPU index serves X+cpu. Only torch comes
    # from that index (--no-deps), and before the package, so pip keeps it when it installs the rest.
    installs = _installs(_make_n("-B", "run"))
    torch = [line for line in installs if "torch==" in line]
    assert len(torch) == 1, installs
    assert f"torch=={_pinned_torch()} " in torch[0] + " ", (torch[0], _pinned_torch())
    assert f"--index-url {CPU_INDEX}" in torch[0] and "--no-deps" in torch[0], torch[0]
    assert installs.index(torch[0]) < next(i for i, line in enumerate(installs) if " -e " in line)


def test_make_run_installs_what_serving_needs_and_make_test_the_development_tools() -> None:
    run = _installs(_make_n("-B", "run"))
    assert any(line.endswith(" -e .") for line in run), run
    assert not any("[dev]" in line for line in run), run
    test = _installs(_make_n("-B", "test"))
    assert any(line.endswith("-e '.[dev]'") for line in test), test


def _stamped_venv(tmp_path: Path, *stamps: str) -> str:
    """A virtual-environment directory with the given stamp files, newer than pyproject.toml."""
    venv = tmp_path / "venv"
    venv.mkdir()
    newer = max(os.stat(REPO / "pyproject.toml").st_mtime, os.stat(REPO / "Makefile").st_mtime) + 1
    for name in stamps:
        (venv / name).touch()
        os.utime(venv / name, (newer, newer))
    return str(venv)


def test_make_test_after_make_run_adds_only_the_development_tools(tmp_path: Path) -> None:
    venv = _stamped_venv(tmp_path, ".installed")
    lines = _make_n(f"VENV={venv}", "test")
    assert _installs(lines) == [f"{venv}/bin/python -m pip install --progress-bar on -e '.[dev]'"], lines
    assert not any("-m venv" in line for line in lines), lines


def test_make_run_after_make_test_installs_nothing_more(tmp_path: Path) -> None:
    venv = _stamped_venv(tmp_path, ".installed", ".installed-dev")
    for target in ("run", "test"):
        lines = _make_n(f"VENV={venv}", target)
        assert _installs(lines) == [] and not any("-m venv" in line for line in lines), (target, lines)


def test_make_lint_runs_ruff_and_the_type_checker(tmp_path: Path) -> None:
    venv = _stamped_venv(tmp_path, ".installed", ".installed-dev")
    (command,) = _make_n(f"VENV={venv}", "lint")
    steps = command.split(" && ")
    assert steps == [
        f"{venv}/bin/ruff check .",
        f"{venv}/bin/ruff format --check .",
        f"{venv}/bin/python -m mypy",
    ], command


def test_make_test_runs_the_suite_on_every_core_a_file_per_worker(tmp_path: Path) -> None:
    # pytest-xdist: a worker per core; a test file stays on one worker, so its module fixtures start once.
    venv = _stamped_venv(tmp_path, ".installed", ".installed-dev")
    (command,) = _make_n(f"VENV={venv}", "test")
    assert command == f"{venv}/bin/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder", (
        command
    )


def test_the_longest_files_are_handed_out_first() -> None:
    # tests/conftest.py orders the collection; `make test` keeps that order (--no-loadscope-reorder).
    for path in LONG_FILES_FIRST:
        assert (REPO / path).is_file(), f"{path} is listed in LONG_FILES_FIRST but does not exist"
    nodeids = [
        "tests/a_test.py::first",
        "tests/reliability/test_overload.py::one",
        "tests/a_test.py::second",
        "tests/reliability/test_schemathesis.py::two",
        "tests/reliability/test_overload.py::three",
    ]
    items = [cast(pytest.Item, SimpleNamespace(nodeid=nodeid)) for nodeid in nodeids]
    pytest_collection_modifyitems(cast(pytest.Config, None), items)
    assert [item.nodeid for item in items] == [
        "tests/reliability/test_schemathesis.py::two",
        "tests/reliability/test_overload.py::one",
        "tests/reliability/test_overload.py::three",
        "tests/a_test.py::first",
        "tests/a_test.py::second",
    ]
