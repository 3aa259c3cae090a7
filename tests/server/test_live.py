"""Behaviour that needs a real socket: client disconnects, and SIGTERM on a real server process, both with
the fake engine (tests/server/routes/test_conformance.py repeats the process tests with the tiny model)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from devtools.fake_engine import FakeClef

from tests.server.conftest import LiveServer, free_port
from tests.server.helpers import wait_for
from tests.serving import start_server_process

REPO = Path(__file__).resolve().parents[2]
NOUL = {"type": "noul", "instructions": "Is a refund requested?"}


class HeldEngine(FakeClef):
    """Each engine call waits for ``gate``; ``entered`` counts the calls that started."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    def decide_encoded(self, items: Any) -> list[dict[str, Any]]:
        self.entered.release()
        assert self.gate.wait(20)
        return super().decide_encoded(items)


def _raw_post(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock.sendall(head + data)
    return sock


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_client_that_disconnects_while_queued_costs_no_compute(
    live_fake: Callable[..., LiveServer],
) -> None:
    engine = HeldEngine()
    live = live_fake(engine)
    runtime = live.app.state.runtime
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=live.url, timeout=20) as client:
        first = pool.submit(client.post, "/v1/systemone", json={"state": "first", "questions": {"q": NOUL}})
        assert engine.entered.acquire(timeout=10)  # the engine is busy with "first"
        quitter = _raw_post(live.port, {"state": "quitter", "questions": {"q": NOUL}})
        wait_for(lambda: runtime.queue_depth() == 1)
        quitter.close()
        wait_for(lambda: _metric(client.get("/metrics").text, "clef_client_disconnects_total") == 1)
        engine.gate.set()
        assert first.result(10).status_code == 200
        after = client.post("/v1/systemone", json={"state": "after", "questions": {"q": NOUL}})
        assert after.status_code == 200
    states = [state for batch in engine.batches for state in batch]
    assert "quitter" not in states
    assert states == ["first", "after"]
    assert 'status="499"' in httpx.get(live.url + "/metrics").text


def test_a_client_that_disconnects_while_running_does_not_disturb_the_server(
    live_fake: Callable[..., LiveServer],
) -> None:
    engine = HeldEngine()
    live = live_fake(engine)
    quitter = _raw_post(live.port, {"state": "quitter", "questions": {"q": NOUL}})
    assert engine.entered.acquire(timeout=10)
    quitter.close()
    time.sleep(0.05)
    engine.gate.set()
    response = httpx.post(
        live.url + "/v1/systemone", json={"state": "next", "questions": {"q": NOUL}}, timeout=10
    )
    assert response.status_code == 200


SERVE_FAKE = textwrap.dedent(
    """
    import sys
    from clef_runtime.serve_command import configure_logging, serve
    from clef_runtime.server.settings import ServerSettings
    from devtools.fake_engine import FakeClef
    configure_logging("info")
    settings = ServerSettings(model="fake", port=int(sys.argv[1]), max_batch_size=2)
    engine = FakeClef(delay_s=float(sys.argv[2]), warmup_s=float(sys.argv[3]))

    def factory(s):
        if len(sys.argv) > 4:
            raise FileNotFoundError("no checkpoint at /nowhere")
        return engine

    sys.exit(serve(settings, engine_factory=factory))
    """
)


def start_fake_process(
    delay_s: float, warmup_s: float = 0.0, wait_for: str = "/ready"
) -> tuple[subprocess.Popen[bytes], str]:
    """The fake engine's server in a process (its output on a pipe), waited on until ``wait_for`` is 200.
    Returns (process, url)."""
    port = free_port()
    argv = [sys.executable, "-c", SERVE_FAKE, str(port), str(delay_s), str(warmup_s)]
    server = start_server_process(argv, port, wait_for=wait_for, timeout=60)
    return server.process, server.url


@pytest.mark.slow
def test_sigterm_finishes_accepted_requests_then_exits_0() -> None:
    # 1 s per engine call: with the suite's other workers on the same cores, the 8 requests may take a while
    # to arrive, and the state observed below (some running, some queued) must outlast their arrival.
    process, url = start_fake_process(delay_s=1.0)
    try:
        bodies = [{"state": f"request {i}", "questions": {"q": NOUL}} for i in range(8)]
        with ThreadPoolExecutor(8) as pool, httpx.Client(base_url=url, timeout=30) as probe:
            futures = [pool.submit(httpx.post, url + "/v1/systemone", json=b, timeout=30) for b in bodies]

            def queued_and_running() -> bool:
                # One scrape: at this instant requests are being computed and others wait behind them (8
                # requests, batches of 2, 1 s per engine call), and the server handles all 8 (the probe's
                # own request is the 9th in flight).
                metrics = probe.get("/metrics").text
                return (
                    _metric(metrics, "clef_inflight_requests") >= 9
                    and _metric(metrics, "clef_running_requests") >= 1
                    and _metric(metrics, "clef_queue_depth") >= 1
                )

            wait_for(queued_and_running)
            process.send_signal(signal.SIGTERM)
            responses = [f.result(30) for f in futures]
        assert [r.status_code for r in responses] == [200] * 8
        assert process.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    log = process.stdout.read().decode() if process.stdout else ""
    assert "stopped" in log
    assert f"listening on {url} " in log  # the address a user opens, also when the port was chosen free


@pytest.mark.slow
def test_sigterm_while_the_model_loads_exits_0_at_once() -> None:
    process, url = start_fake_process(delay_s=0.0, warmup_s=120.0, wait_for="/health")
    try:
        assert httpx.get(url + "/health", timeout=5).json()["state"] == "loading"
        refused = httpx.post(url + "/v1/systemone", json={"state": "x", "questions": {"q": NOUL}}, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0  # not after the 120 s warm-up
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.slow
def test_a_model_that_fails_to_load_exits_1() -> None:
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-c", SERVE_FAKE, str(port), "0", "0", "broken"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert b"no checkpoint at /nowhere" in result.stderr
