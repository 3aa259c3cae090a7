"""Container images in tests, as these machines run them: Debian's podman as root with runc (crun refuses
the hybrid cgroup setup), lowered ulimits and the host's network; a Debian bookworm base made with
debootstrap (no image registry is reachable, Debian's mirror is); the image built from deploy/Containerfile
with exactly the command README documents.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from devtools.apt import ensure_commands
from devtools.harness import REPO

__all__ = [
    "BASE_IMAGE",
    "PODMAN",
    "ULIMITS",
    "build_command",
    "debian_base_image",
    "ensure_podman",
    "podman",
    "wheels_folder",
]

PODMAN: tuple[str, ...] = ("podman", "--runtime", "runc")
ULIMITS: tuple[str, ...] = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
BASE_IMAGE = "localhost/clef-test-base:bookworm"
"""A bare Debian bookworm with python3, python3-venv and python3-pip: what the Containerfile must build on
besides the public Python image."""

_MIRROR = "http://deb.debian.org/debian"
_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clef-runtime-tests"
_LOCAL_CAS = Path("/usr/local/share/ca-certificates")


def ensure_podman() -> None:
    """podman, runc, debootstrap and podman-compose, installed with apt-get when missing (as root)."""
    tools = ["podman", "runc", "debootstrap", "podman-compose"]
    ensure_commands(tools, tools)


def podman(*arguments: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman --runtime runc ARGUMENTS`` with its output captured. Raises CalledProcessError (with the
    output) when ``check`` and it fails."""
    done = subprocess.run([*PODMAN, *arguments], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done


def debian_base_image() -> str:
    """:data:`BASE_IMAGE`, made once per machine (debootstrap, about a minute) and kept in podman's storage.

    The machine's own extra CA certificates (``/usr/local/share/ca-certificates``: an egress proxy's) go in
    too, so that pip inside the build reaches PyPI as it does here; that is this machine's business, not
    the Containerfile's."""
    with open(Path(tempfile.gettempdir()) / "clef-tests-base-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
            return BASE_IMAGE
        _CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=_CACHE) as work:
            rootfs = Path(work) / "rootfs"
            subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=python3,python3-venv,python3-pip,ca-certificates",
                    "bookworm",
                    str(rootfs),
                    _MIRROR,
                ],
                check=True,
                capture_output=True,
                timeout=1200,
            )
            extra = sorted(_LOCAL_CAS.glob("*.crt")) if _LOCAL_CAS.is_dir() else []
            for certificate in extra:
                shutil.copy(certificate, rootfs / "usr/local/share/ca-certificates" / certificate.name)
            if extra:
                subprocess.run(
                    ["chroot", str(rootfs), "update-ca-certificates"], check=True, capture_output=True
                )
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            bundle = "/etc/ssl/certs/ca-certificates.crt"
            environment = ["--change", f"ENV PIP_CERT={bundle}", "--change", f"ENV SSL_CERT_FILE={bundle}"]
            imported = subprocess.run(
                [*PODMAN, "import", *environment, "-", BASE_IMAGE],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
                timeout=600,
            )
            tar.wait()
            if imported.returncode != 0:
                raise RuntimeError(f"podman import failed:\n{imported.stderr[-2000:]}")
    return BASE_IMAGE


def wheels_folder(fallback: Path) -> Path:
    """The folder pip's configuration names for wheels (``global.find-links``; these machines keep torch's
    CPU wheel there), else ``fallback`` (an empty folder: the build then takes torch from PyTorch's index)."""
    done = subprocess.run(
        [str(REPO / ".venv/bin/python"), "-m", "pip", "config", "get", "global.find-links"],
        capture_output=True,
        text=True,
    )
    configured = Path(done.stdout.strip().removeprefix("file://")) if done.returncode == 0 else None
    return configured if configured is not None and configured.is_dir() else fallback


def build_command(base: str, wheels: Path, tag: str) -> Sequence[str]:
    """README's build command for the CPU image (from the repository root), tagged ``tag``."""
    return [
        *PODMAN,
        "build",
        "--network=host",
        *ULIMITS,
        "-v",
        f"{wheels}:/wheels:ro",
        "--build-arg",
        f"BASE={base}",
        "-f",
        "deploy/Containerfile",
        "-t",
        tag,
        ".",
    ]
