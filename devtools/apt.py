"""Debian packages the tests need (chromium, podman, ...), installed with apt-get when missing and we are
root, one installer at a time; never a download from anywhere but the machine's package mirror."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PackageMissing", "ensure_commands"]


class PackageMissing(RuntimeError):
    """A package is not installed and could not be installed here; the message says what to run."""


def ensure_commands(commands: Sequence[str], packages: Sequence[str]) -> None:
    """Make sure every command of ``commands`` is on PATH (or, given with a slash, exists), installing
    ``packages`` with apt-get when one is missing and we are root (``apt-get update`` only if the first
    install fails). Raises :class:`PackageMissing` when they are missing and cannot be installed."""
    if all(_present(command) for command in commands):
        return
    wanted = " ".join(packages)
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PackageMissing(
            f"{', '.join(commands)} missing: install Debian's packages (sudo apt-get install -y {wanted})"
        )
    # Parallel test workers (pytest -n) would run apt-get at once, and all but one would fail on dpkg's lock.
    with open(Path(tempfile.gettempdir()) / "clef-tests-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(_present(command) for command in commands):  # another worker may have installed them
            _apt_install(packages)
    missing = [command for command in commands if not _present(command)]
    if missing:
        raise PackageMissing(f"apt-get installed {wanted} but {', '.join(missing)} is still missing")


def _present(command: str) -> bool:
    """A command on PATH, or a path (with a slash) that exists."""
    return Path(command).exists() if "/" in command else shutil.which(command) is not None


def _apt_install(packages: Sequence[str]) -> None:
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise PackageMissing(f"apt-get install {' '.join(packages)} failed:\n{done.stderr[-2000:]}")
