"""Fixtures for the evaluation tests: a real loopback server around the session's tiny model (``tiny``, from
tests/conftest.py), and a small case file taken from examples/cases.jsonl (every question type)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from clef_runtime.engine.clef import Clef
from clef_runtime.server.app import create_app
from clef_runtime.server.settings import ServerSettings
from tests.server.conftest import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "cases.jsonl"
#: Lines of the example file used by the slow tests: two support tickets, two posts, two incidents.
SMALL_LINES = (1, 7, 15, 16, 27, 28)


@pytest.fixture(scope="session")
def tiny_url(tiny: Clef) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a uvicorn server (in a thread) answering with ``tiny``."""
    port = free_port()
    settings = ServerSettings(model="tiny", port=port, jobs=False)  # a jobs database has one owner
    app = create_app(settings, engine_factory=lambda s: tiny)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    while not (server.started and app.state.runtime.state == "ready"):
        assert time.monotonic() < deadline, "the tiny server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="session")
def small_cases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()
    path = tmp_path_factory.mktemp("cases") / "small.jsonl"
    path.write_text("\n".join(lines[n - 1] for n in SMALL_LINES) + "\n", encoding="utf-8")
    return path
