"""Pinned client environments: a client library whose requirements clash with the repository's own pins
(instructor 1.17.0 needs openai<=3.3; the repository pins openai 3.57) is tested from a virtual environment
of its own, built from ``tests/clients/envs/<name>.txt`` (exact pins) and run as a subprocess.

The environment lives in ``.venv/client-envs/<name>-<hash>``, the hash over the requirements file and the
Python version, so an edited pin or another interpreter gets a fresh one and an unchanged one is reused
(``make clean`` removes it with ``.venv``). It is built with ``python -m venv`` and ``pip install -r``
under a file lock (two pytest runs at once build it once); a ``.complete`` marker written last tells a
finished build from an interrupted one, which is removed and built again. A failed build raises
:class:`EnvBuildError` with pip's whole output.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.serving import REPO

REQUIREMENTS = Path(__file__).resolve().parent / "envs"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = REPO / ".venv" / "client-envs"
BUILD_TIMEOUT_S = 900


class EnvBuildError(AssertionError):
    """Building a client environment failed; the message has the failing command and all of its output."""


def env_dir(name: str) -> Path:
    """Where the environment for ``envs/<name>.txt`` is (built or not)."""
    requirements = (REQUIREMENTS / f"{name}.txt").read_bytes()
    digest = hashlib.sha256(requirements + sys.version.encode()).hexdigest()[:12]
    return ROOT / f"{name}-{digest}"


def _run(argv: Sequence[str], log: list[str]) -> None:
    log.append("$ " + " ".join(str(a) for a in argv))
    try:
        done = subprocess.run(
            [str(a) for a in argv], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as error:
        log.append(f"timed out after {BUILD_TIMEOUT_S} s\n{error.stdout or ''}{error.stderr or ''}")
        raise EnvBuildError("\n".join(log)) from None
    log.append(done.stdout + done.stderr)
    if done.returncode != 0:
        log.append(f"exit status {done.returncode}")
        raise EnvBuildError("building a client environment failed:\n" + "\n".join(log))


def client_env(name: str) -> Path:
    """The Python interpreter of the environment for ``envs/<name>.txt``, built first if it is not yet."""
    target = env_dir(name)
    python = target / "bin" / "python"
    marker = target / ".complete"
    if marker.exists():
        return python
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists():  # built by another run while this one waited
            return python
        shutil.rmtree(target, ignore_errors=True)  # an interrupted build
        log: list[str] = []
        started = time.monotonic()
        _run([sys.executable, "-m", "venv", target], log)
        pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        _run([*pip, "install", "-r", REQUIREMENTS / f"{name}.txt"], log)
        _run([*pip, "check"], log)
        marker.write_text(json.dumps({"build_seconds": round(time.monotonic() - started, 1)}) + "\n")
    return python


def run_in_env(name: str, script: Path | str, *args: str, timeout: float = 300) -> str:
    """Run ``script`` (a path, or a file name under tests/clients/scripts) with ``args`` in the environment
    ``name`` and return its standard output; a non-zero exit fails with both streams."""
    python = client_env(name)
    path = Path(script) if Path(script).is_absolute() else SCRIPTS / script
    done = subprocess.run(
        [str(python), str(path), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    command = " ".join([path.name, *args])
    assert done.returncode == 0, (
        f"{command} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done.stdout


def run_json(name: str, script: str, *args: str) -> Any:
    """:func:`run_in_env`, the script's last line of output decoded as JSON."""
    out = run_in_env(name, script, *args)
    return json.loads(out.strip().splitlines()[-1])
