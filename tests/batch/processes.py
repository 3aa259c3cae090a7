"""``clef batch`` as a user's shell runs it: a separate process of this checkout, for the tests that kill it
or the Ray workers it starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_batch(*args: str, log: Path) -> subprocess.Popen[bytes]:
    """``python -m clef_runtime.cli batch ARGS`` with this checkout's package first on the path; stdout and
    stderr go to ``log``."""
    pythonpath = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env = {**os.environ, "PYTHONPATH": pythonpath, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "clef_runtime.cli", "batch", *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )


def processes_with(marker: bytes) -> dict[int, str]:
    """The processes whose command line (Ray's process title) holds ``marker``: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\x00", b" ").strip()
        except OSError:
            continue
        if marker in cmdline:
            found[int(entry.name)] = cmdline.decode(errors="replace")
    return found
