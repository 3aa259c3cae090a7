"""benchmarks/device/wheels.sh refuses bad arguments with exit status 2 before downloading anything (the
download itself needs PyPI and is exercised when a device check is prepared, docs/gpu.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "wheels.sh"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "usage:"),
        (["out", "--python-version"], "usage:"),
        (["out", "--python-version", "twelve"], "must look like 3.12"),
        (["out", "--colour"], "usage:"),
    ],
)
def test_bad_arguments_exit_2_and_download_nothing(
    tmp_path: Path, arguments: list[str], message: str
) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), *arguments],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()
