"""Browser-test support: Debian's Chromium (installed with apt when missing and we are root, never a
browser download), Playwright launched on it, and a tiny-model server on a loopback port in a thread.

Used by tests/server/pages/test_pages_browser.py and scripts/screenshots.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from clef_runtime.server.app import create_app
from clef_runtime.server.settings import ServerSettings
from devtools.apt import PackageMissing, ensure_commands
from devtools.harness import free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
"""No sandbox (CI runs as root); no background traffic of the browser's own (updates, sync), so the only
requests are the page's."""


ChromiumMissing = PackageMissing
"""Chromium is not installed and could not be installed here."""


def ensure_chromium() -> Path:
    """Return the path of Debian's chromium, installing the ``chromium`` package with apt-get first when it
    is missing and we are root. Raises :class:`ChromiumMissing` saying what to run when it cannot be."""
    if not CHROMIUM.exists():
        ensure_commands([str(CHROMIUM)], ["chromium"])
    return CHROMIUM


@contextmanager
def chromium_browser() -> Iterator[Any]:
    """A Playwright ``Browser`` on Debian's chromium, closed on exit."""
    from playwright.sync_api import sync_playwright

    executable = ensure_chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(executable), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class TinyServer:
    url: str
    app: FastAPI


@contextmanager
def tiny_server(**overrides: Any) -> Iterator[TinyServer]:
    """``clef serve --model tiny`` in a thread on a free loopback port, ready (loaded and warmed) on entry."""
    port = free_port()
    # No jobs: a jobs database has one owner, and the pages need none.
    settings = ServerSettings(**{"model": "tiny", "port": port, "jobs": False, **overrides})
    app = create_app(settings)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        runtime = app.state.runtime
        deadline = time.monotonic() + 300  # a slow, shared machine; not a timing assertion
        while not (server.started and runtime.state == "ready"):
            if runtime.state == "failed" or time.monotonic() > deadline:
                raise RuntimeError(f"the tiny server did not start (state {runtime.state})")
            time.sleep(0.05)
        yield TinyServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(30)


def expected_meters(body: dict[str, Any]) -> dict[str, float]:
    """Accessible name -> probability, from an API answer, as the pages' meters name them (noul: p(true)
    and round(1 - p, 4))."""
    meters = {}
    for qid, answer in body["answers"].items():
        if answer["type"] == "noul":
            meters[f"{qid}: true"] = answer["noul"]
            meters[f"{qid}: false"] = round(1 - answer["noul"], 4)
        else:
            for option, p in answer["probabilities"].items():
                meters[f"{qid}: {option}"] = p
    return meters
