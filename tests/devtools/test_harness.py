"""`devtools.harness`: start a real server, load it, stop it (the tiny model and an instant engine)."""

from __future__ import annotations

import socket
import sys

import httpx
import pytest
from devtools.harness import (
    engine_launcher,
    free_port,
    post_all,
    start_clef_server,
    start_server_process,
)

BODY = {"state": "I was charged twice", "questions": {"refund": {"type": "noul"}}}


@pytest.mark.slow
def test_a_tiny_server_starts_answers_and_stops() -> None:
    server = start_clef_server("tiny", log_level="warning", jobs=False, cache_mb=0)
    try:
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 200
        load = post_all(server.url, [BODY, {**BODY, "state": "another"}], 2)
        assert load.errors == 0 and len(load.latencies_s) == 2 and all(load.input_tokens)
        assert server.rss_bytes() > 0
    finally:
        status = server.stop()
    assert status == 0
    assert server.process.poll() == 0


def test_an_instant_engine_is_served_through_the_real_server() -> None:
    launcher = engine_launcher("benchmarks.bench_server:null_engine")
    server = start_clef_server("null", launcher=launcher, log_level="warning", jobs=False)
    try:
        load = post_all(server.url, [BODY], 1)
        assert load.errors == 0 and load.server_ms  # the server timed its own part
    finally:
        assert server.stop() == 0


def test_a_server_that_exits_is_reported_with_its_output() -> None:
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3") as raised:
        start_server_process(argv, free_port(), timeout=60)
    assert "no model here" in str(raised.value)


def test_free_port_is_bindable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
