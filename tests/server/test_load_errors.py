"""``clef serve`` with a model that cannot be had: one clear line, exit 1, no traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clef_runtime.model.checkpoint import PINNED_REVISION


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends: connections are refused


@pytest.mark.slow  # a fresh `clef serve` process (imports torch)
def test_serve_without_network_logs_one_line_saying_what_to_do_and_exits_1(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",  # nothing leaves the machine
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "0",
    }
    command = ["serve", "--model", "Cloudflare/clef-flash", "--port", str(_closed_port())]
    done = subprocess.run(
        [sys.executable, "-m", "clef_runtime.cli", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "Retry" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line or "WARNING" in line]
    assert len(errors) == 1, done.stderr
    assert "cannot be reached" in errors[0]
    assert f"hf download Cloudflare/clef-flash --revision {PINNED_REVISION}" in errors[0]


HUB_WARNING = """
import logging
from clef_runtime.serve_command import configure_logging
from huggingface_hub.utils import logging as hub_logging

configure_logging("info")
hub_logging.get_logger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
"""


def test_huggingface_hub_warnings_print_once_under_the_server_logging() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HUB_WARNING], capture_output=True, text=True, timeout=120, check=True
    )
    lines = [line for line in done.stderr.splitlines() if "Retrying in 1s" in line]
    assert len(lines) == 1, done.stderr
    assert " WARNING huggingface_hub.utils._http: " in lines[0]  # in the server's own format
