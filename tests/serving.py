"""Start a server process and wait until it answers: the one helper the tests and the benchmarks share.

Importable from ``benchmarks/`` as ``tests.serving`` (they put the repository root on ``sys.path``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

__all__ = ["REPO", "ServerProcess", "clef_serve_argv", "free_port", "start_server_process"]


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A server subprocess, its URL and where its output goes (a log file, or a pipe when ``log_path`` is
    None)."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path | None = None

    def log(self) -> str:
        """The output so far (from the pipe: everything once the process has ended)."""
        if self.log_path is not None:
            return self.log_path.read_text(errors="replace")
        stdout = self.process.stdout
        return stdout.read().decode(errors="replace") if stdout is not None else ""

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait up to ``timeout`` s (kill after). Returns the exit status (-9 when killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                return -9
        return int(self.process.returncode)


def clef_serve_argv(model: str, port: int, *args: str) -> list[str]:
    """``python -m clef_runtime.cli serve --model MODEL --port PORT ARGS``."""
    return [sys.executable, "-m", "clef_runtime.cli", "serve", "--model", model, "--port", str(port), *args]


def start_server_process(
    argv: Sequence[str],
    port: int,
    *,
    log_path: Path | None = None,
    wait_for: str = "/ready",
    timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Run ``argv`` (a server listening on ``port``) from the repository root, with the ``CLEF_*`` variables
    of this process removed and the repository on ``PYTHONPATH``, and wait until ``wait_for`` answers 200.

    Returns the running server. Raises RuntimeError (with its output) when it exits first or does not answer
    within ``timeout`` s (it is killed then).
    """
    environment = {key: value for key, value in os.environ.items() if not key.startswith("CLEF_")}
    environment["PYTHONPATH"] = str(REPO) + os.pathsep + environment.get("PYTHONPATH", "")
    environment.update(env or {})
    if log_path is None:
        process = subprocess.Popen(
            list(argv), cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    else:
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                list(argv), cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT
            )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()[-4000:]}")
        if time.monotonic() > deadline:
            process.kill()
            process.wait(10)
            raise RuntimeError(
                f"the server did not answer {wait_for} within {timeout} s:\n{server.log()[-4000:]}"
            )
        try:
            if httpx.get(server.url + wait_for, timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.05)
