"""`make run` on a fresh machine says what it installs and shows pip's progress (no minutes of silence)."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_install_steps_are_announced_and_not_silenced() -> None:
    # -n: print the commands a fresh setup would run (-B: as if nothing were built), run nothing.
    done = subprocess.run(
        ["make", "-n", "-B", "run"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    lines = done.stdout.splitlines()
    steps = [line for line in lines if line.startswith('echo "==> [')]
    assert len(steps) == 4, done.stdout
    installs = [line for line in lines if "pip install" in line and "--upgrade pip" not in line]
    assert any("torch==" in line for line in installs) and any("'.[dev]'" in line for line in installs)
    assert all("--quiet" not in line and "-q " not in line for line in installs), installs
    assert lines[-1].endswith("--port 8094") and "serving" in lines[-2]
