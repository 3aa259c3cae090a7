"""`make run` on a fresh machine says what it installs and shows pip's progress (no minutes of silence)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_install_steps_are_announced_and_not_silenced() -> None:
    # -n: print the commands a fresh setup would run (-B: as if nothing were built), run nothing.
    # Under `make test` the parent make's variables would make this one a sub-make that prints
    # "Entering/Leaving directory" lines: run it as a user would, from a plain shell.
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = done.stdout.splitlines()
    steps = [line for line in lines if line.startswith('echo "==> [')]
    assert len(steps) == 4, done.stdout
    installs = [line for line in lines if "pip install" in line and "--upgrade pip" not in line]
    assert any("torch==" in line for line in installs) and any("'.[dev]'" in line for line in installs)
    assert all("--quiet" not in line and "-q " not in line for line in installs), installs
    assert lines[-1].endswith("--port 8094") and "serving" in lines[-2]
