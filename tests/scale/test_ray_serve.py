"""`clef serve --ray` on a local 2-replica Ray Serve cluster of the tiny model (a real server process with a
local Ray head on 127.0.0.1): state affinity, spreading, a replica killed mid-load, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY_PROCESS_MARKERS = ("ray::", "raylet", "gcs_server", "ray/dashboard", "ray/autoscaler")


@dataclass
class RayServer:
    process: subprocess.Popen[bytes]
    url: str


def ray_processes() -> list[str]:
    """Command lines of Ray's processes on this machine."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\x00", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in RAY_PROCESS_MARKERS):
            found.append(f"{entry.name} {cmdline[:120]}")
    return found


def replica_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica:clef:ClefModel" in cmdline:
                pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    assert not ray_processes(), "Ray is already running on this machine"
    port = free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    command = [
        sys.executable,
        "-m",
        "clef_runtime.cli",
        "serve",
        "--ray",
        "--replicas",
        "2",
        "--model",
        "tiny",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--model", "tiny", "--port", str(port), "--cache-mb", "64"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # signals from the test reach this process only
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                ready = httpx.get(url + "/ready", timeout=5)
                if ready.status_code == 200 and ready.json()["replicas"]["up"] == 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield RayServer(process, url)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def decide(url: str, state: str, question: str) -> httpx.Response:
    body = {"state": state, "questions": {question: {"type": "noul", "instructions": f"Is it {question}?"}}}
    response = httpx.post(url + "/v1/systemone", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def test_one_state_goes_to_one_replica_and_hits_after_the_first(ray_server: RayServer) -> None:
    state = "The customer was charged twice for the same order and asks for a refund. " * 5
    responses = [decide(ray_server.url, state, f"q{i}") for i in range(4)]
    replicas = {r.headers["x-clef-replica"] for r in responses}
    assert len(replicas) == 1
    # The replica that computed the state first answers the next questions from its state cache.
    assert [r.headers["x-clef-state-cache"] for r in responses] == ["miss", "hit", "hit", "hit"]
    # The same state through the OpenAI-shaped route reaches the same replica.
    other = httpx.post(
        ray_server.url + "/v1/decisions",
        json={"input": state, "questions": [{"type": "predicate", "name": "q9", "instructions": "Refund?"}]},
        timeout=120,
    )
    assert other.status_code == 200 and other.headers["x-clef-replica"] in replicas
    assert other.headers["x-clef-state-cache"] == "hit"
    metrics = httpx.get(ray_server.url + "/metrics", timeout=10).text
    assert f'clef_replica_requests_total{{replica="{replicas.pop()}",state_cache="hit"}} 4.0' in metrics


def test_distinct_states_spread_over_both_replicas(ray_server: RayServer) -> None:
    with ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(lambda i: decide(ray_server.url, f"distinct state number {i}", "q"), range(16))
        )
    counts = Counter(r.headers["x-clef-replica"] for r in responses)
    assert len(counts) == 2 and min(counts.values()) >= 3
    ready = httpx.get(ray_server.url + "/ready", timeout=10).json()
    assert ready["replicas"] == {"up": 2, "target": 2}


def test_a_replica_killed_mid_load_loses_no_request(ray_server: RayServer) -> None:
    pids = replica_pids()
    assert len(pids) == 2
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(decide, ray_server.url, f"load state {i} " * 40, "q") for i in range(24)]
        time.sleep(0.5)
        os.kill(pids[0], signal.SIGKILL)
        responses = [f.result(240) for f in futures]  # decide() asserts every one is 200
    assert len(responses) == 24
    # Serve replaces the dead replica; /ready reports the replicas that are up meanwhile.
    deadline = time.monotonic() + 240
    while True:
        ready = httpx.get(ray_server.url + "/ready", timeout=10)
        # Both views must agree: Serve's count and two live replica processes (the replacement's process
        # title is set a moment after Serve counts it).
        now = replica_pids()
        up = ready.status_code == 200 and ready.json()["replicas"]["up"] == 2
        if up and pids[0] not in now and len(now) == 2:
            break
        assert time.monotonic() < deadline, (ready.text, now)
        time.sleep(1)


def test_sigterm_stops_every_process_it_started(ray_server: RayServer) -> None:
    # Runs last in this module (pytest keeps file order): the fixture's server goes away here.
    ray_server.process.send_signal(signal.SIGTERM)
    assert ray_server.process.wait(120) == 0
    deadline = time.monotonic() + 60
    while ray_processes():
        assert time.monotonic() < deadline, ray_processes()
        time.sleep(1)
