"""What many test modules need: the ``clef`` command run in this process or in a fresh one, and the requests
they all send. The session-wide tiny model is the ``tiny`` fixture of ``tests/conftest.py``."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import numpy as np
from PIL import Image

__all__ = [
    "MINIMAL_REQUEST",
    "CliRun",
    "JsonHandler",
    "png_data_url",
    "run_cli",
    "run_cli_process",
    "stub_server",
]

MINIMAL_REQUEST: dict[str, Any] = {"state": "a ticket", "questions": {"q": {"type": "noul"}}}
"""The smallest valid System One request: a text state and one noul question."""


@dataclass(frozen=True)
class CliRun:
    """What an in-process ``clef`` run left: named like `subprocess.CompletedProcess`, so the same checks
    read both."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(*args: str, stdin: str = "") -> CliRun:
    """``clef ARGS`` through `clef_runtime.cli.main` in this process, ``stdin`` as its standard input (text
    and bytes, as the jobs client reads it), stdout and stderr captured. Fast: no interpreter start and no
    second model load, but a warning sent through logging goes to pytest's log capture, not to ``stderr``
    (use `run_cli_process` to see it)."""
    from clef_runtime.cli import main

    out, err = io.StringIO(), io.StringIO()
    source = io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8")), encoding="utf-8")
    with mock.patch.object(sys, "stdin", source), redirect_stdout(out), redirect_stderr(err):
        status = main(list(args))
    return CliRun(status, out.getvalue(), err.getvalue())


def run_cli_process(*args: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m clef_runtime.cli ARGS`` in a fresh interpreter (what a user's shell runs)."""
    return subprocess.run(
        [sys.executable, "-m", "clef_runtime.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def png_data_url(width: int, height: int, seed: int) -> str:
    """A ``data:image/png`` URL of random RGB pixels (a request image in Cloudflare's form)."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class JsonHandler(BaseHTTPRequestHandler):
    """Base of a scripted HTTP stub: quiet, with `reply` sending one JSON body."""

    def log_message(self, *args: Any) -> None:
        return None

    def reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> bytes:
        """The request body."""
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))


@contextmanager
def stub_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of ``handler`` served on a thread until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class ManualClock:
    """A clock the test moves by hand (``clock.now += 1``): time-based logic tested without waiting."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
