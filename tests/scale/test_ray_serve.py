"""`clef serve --ray` on a local 2-replica Ray Serve cluster of the tiny model (a real server process with a
local Ray head on 127.0.0.1), one cluster for the whole module: state affinity, spreading, every info and
page route, the state cache on /metrics, a clean log, a replica killed with a request in flight on it (its
replacement then serves and builds its own state cache), a clean stop, and a decision's trace across the
ingress and its replica (tracing on for the whole module, its spans exported when the server stops)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.scale.test_replica_tracing import check_engine_spans
from tests.server.conftest import free_port
from tests.server.helpers import REQUEST
from tests.server.test_tracing import (
    PARENT_ID,
    TRACE_ID,
    TRACEPARENT,
    Received,
    _attributes,
    otlp_http_receiver,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY_PROCESS_MARKERS = ("ray::", "raylet", "gcs_server", "ray/dashboard", "ray/autoscaler")
INFO_ROUTES = ("/health", "/ready", "/v1/models", "/status", "/status.json", "/metrics", "/docs", "/")
QUIET_ROUTES = ("/health", "/ready", "/metrics", "/status.json")  # logged at debug level only
# Ray Serve's own access log: "... -- GET / 200 5.7ms", the ingress's route for every path.
SERVE_ACCESS_LINE = re.compile(r" -- (GET|POST|HEAD) /\S* \d{3} [\d.]+ms")


@dataclass
class RayServer:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        """Until ``text`` is in the log (Ray forwards the replicas' lines a moment after they are written)."""
        deadline = time.monotonic() + timeout
        while text not in self.log_text():
            assert time.monotonic() < deadline, f"{text!r} not in the log:\n{self.log_text()[-4000:]}"
            time.sleep(0.5)


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


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def one_ray_cluster_at_a_time() -> Iterator[None]:
    """Hold a machine-wide file lock: a Ray head is one per machine (its ports, its /tmp/ray session), and
    parallel test workers (pytest -n) or two test runs at once would otherwise start two."""
    with open(Path(tempfile.gettempdir()) / "clef-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def otlp_receiver() -> Iterator[tuple[str, Received]]:
    """The OTLP/HTTP receiver the module's server traces to (it outlives the server)."""
    with otlp_http_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def ray_server(
    tmp_path_factory: pytest.TempPathFactory, otlp_receiver: tuple[str, Received]
) -> Iterator[RayServer]:
    with one_ray_cluster_at_a_time():
        yield from _started_ray_server(tmp_path_factory, otlp_receiver[0])


def _started_ray_server(tmp_path_factory: pytest.TempPathFactory, traces_url: str) -> Iterator[RayServer]:
    assert not ray_processes(), "Ray is already running on this machine"
    port = free_port()
    directory = tmp_path_factory.mktemp("ray")
    log = directory / "serve.log"
    # This checkout's package, not the one the virtual environment installed (another checkout's, maybe).
    pythonpath = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env = {**os.environ, "PYTHONPATH": pythonpath, "RAY_USAGE_STATS_ENABLED": "0"}
    for name in ("RAY_COLOR_PREFIX", "RAY_DEDUP_LOGS"):  # the server's own defaults are under test
        env.pop(name, None)
    # Spans wait in the exporters' buffers until the server stops (a standard SDK variable, which must reach
    # the ingress's and replicas' processes): the stop is what exports them.
    env["OTEL_BSP_SCHEDULE_DELAY"] = "600000"
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
    options = [
        *("--port", str(port), "--cache-mb", "64", "--jobs-db", str(directory / "jobs.sqlite3")),
        *("--otlp-traces-endpoint", traces_url),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, *options],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # signals from the test reach this process only
        )
    server = RayServer(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert process.poll() is None, server.log_text()[-4000:]
            assert time.monotonic() < deadline, server.log_text()[-4000:]
            try:
                ready = httpx.get(server.url + "/ready", timeout=5)
                if ready.status_code == 200 and ready.json()["replicas"]["up"] == 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/systemone", json=body, timeout=240)


def decide(url: str, state: str, question: str) -> httpx.Response:
    body = {"state": state, "questions": {question: {"type": "noul", "instructions": f"Is it {question}?"}}}
    response = post(url, body)
    assert response.status_code == 200, response.text
    return response


def status_of(server: RayServer) -> dict[str, Any]:
    response = httpx.get(server.url + "/status.json", timeout=30)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


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
    (replica,) = replicas
    metrics = httpx.get(ray_server.url + "/metrics", timeout=30).text
    assert f'clef_replica_requests_total{{replica="{replica}",state_cache="hit"}} 4.0' in metrics
    # The replica's own state cache, as of its latest answer: the same figures on /metrics and /status.json.
    hits = re.search(rf'^clef_cache_hits_total\{{replica="{replica}"\}} ([\d.]+)$', metrics, re.MULTILINE)
    assert hits is not None and float(hits.group(1)) >= 4, metrics
    reports = {report["replica"]: report for report in status_of(ray_server)["replicas"]["reports"]}
    assert reports[replica]["state_cache"]["hits"] == float(hits.group(1))


def both_replicas_reported(server: RayServer) -> dict[str, Any]:
    """``/status.json`` once both replicas have answered at least once (their reports ride on answers), so
    a test does not depend on the ones before it."""
    for number in range(64):
        status = status_of(server)
        if len(status["replicas"]["reports"]) == 2:
            return status
        decide(server.url, f"a state for replica reports {number}", "q")
    raise AssertionError(f"one replica never answered: {status_of(server)['replicas']}")


def test_distinct_states_spread_over_both_replicas(ray_server: RayServer) -> None:
    with ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(lambda i: decide(ray_server.url, f"distinct state number {i}", "q"), range(16))
        )
    counts = Counter(r.headers["x-clef-replica"] for r in responses)
    assert len(counts) == 2 and min(counts.values()) >= 3
    ready = httpx.get(ray_server.url + "/ready", timeout=30).json()
    assert ready["replicas"] == {"up": 2, "target": 2}


def test_every_info_and_page_route_answers(ray_server: RayServer) -> None:
    for number, path in enumerate(INFO_ROUTES):
        response = httpx.get(ray_server.url + path, headers={"x-request-id": f"probe-{number}"}, timeout=30)
        assert response.status_code == 200, (path, response.text)
        # One request id, the client's, on every response (Ray Serve's proxy sets it; the app does not).
        assert response.headers.get_list("x-request-id") == [f"probe-{number}"], (path, response.headers)
        assert response.headers["x-typesafe-request-id"] == f"probe-{number}"
        if path not in QUIET_ROUTES:  # the app's request line names the real path, not the ingress's "/"
            ray_server.wait_for_log(f"request_id=probe-{number} GET {path} status=200")
    model = httpx.get(ray_server.url + "/v1/models", timeout=30).json()["data"][0]
    assert (model["id"], model["confidence"], model["owned_by"]) == ("tiny", "seed", "clef-runtime")
    status = both_replicas_reported(ray_server)
    assert (status["state"], status["device"], status["weights"], status["untrained"]) == (
        "ready",
        "cpu",
        "fp32",
        True,
    )
    # Each replica's process and cache, and their sum.
    replicas = status["replicas"]
    assert (replicas["up"], replicas["target"]) == (2, 2)
    assert sorted(report["pid"] for report in replicas["reports"]) == sorted(replica_pids())
    assert status["state_cache"]["misses"] == sum(r["state_cache"]["misses"] for r in replicas["reports"])
    metrics = httpx.get(ray_server.url + "/metrics", timeout=30).text
    for report in replicas["reports"]:
        assert f'clef_cache_misses_total{{replica="{report["replica"]}"}}' in metrics
    log = ray_server.log_text()
    assert "\x1b[" not in log  # no ANSI colour codes
    assert not SERVE_ACCESS_LINE.search(log), SERVE_ACCESS_LINE.search(log)


def test_a_replica_killed_with_a_request_in_flight_loses_no_request(ray_server: RayServer) -> None:
    url = ray_server.url
    reports = both_replicas_reported(ray_server)["replicas"]["reports"]
    pids = {report["replica"]: report["pid"] for report in reports}
    assert sorted(pids.values()) == sorted(replica_pids())
    state = "The parcel arrived damaged and the customer asks for a replacement, not a refund. " * 3
    victim = decide(url, state, "warm").headers["x-clef-replica"]  # the state's owner, by affinity
    (survivor,) = set(pids) - {victim}
    # The same state goes to the same replica; thousands of words of instructions keep it busy for seconds
    # each, and three of them queue there, so the kill lands inside the work on any machine speed.
    slow = [
        {
            "state": state,
            "questions": {"slow": {"type": "noul", "instructions": f"Case {n}. " + "Is it damaged? " * 3400}},
        }
        for n in range(3)
    ]
    others = [
        {"state": f"another state {i}", "questions": {"q": {"type": "noul", "instructions": "Urgent?"}}}
        for i in range(8)
    ]
    with ThreadPoolExecutor(len(slow) + len(others)) as pool:
        used_before = cpu_seconds(pids[victim])
        slow_futures = [pool.submit(post, url, body) for body in slow]
        # In flight: sent to a replica by the ingress, and the victim computing (its CPU time rising).
        deadline = time.monotonic() + 120
        while (
            status_of(ray_server)["queue_depth"] < len(slow) or cpu_seconds(pids[victim]) - used_before < 0.1
        ):
            assert not any(f.done() for f in slow_futures), [
                f.result().text for f in slow_futures if f.done()
            ]
            assert time.monotonic() < deadline, "the slow requests never ran on their replica"
            time.sleep(0.02)
        other_futures = [pool.submit(post, url, body) for body in others]
        os.kill(pids[victim], signal.SIGKILL)
        assert not any(f.done() for f in slow_futures), "a slow request finished before the kill"
        answers = [future.result(300) for future in (*slow_futures, *other_futures)]
    # Nothing accepted is lost: the survivor answers every request, those that died with the victim included.
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers if a.is_error]
    # The slow requests were on the victim when it died: the survivor computed them again.
    assert {a.headers["x-clef-replica"] for a in answers[: len(slow)]} == {survivor}
    ray_server.wait_for_log("a replica died with a request in flight")
    # Serve replaces the dead replica; /ready and /status.json report the replicas that are up meanwhile.
    deadline = time.monotonic() + 240
    while True:
        ready = httpx.get(url + "/ready", timeout=30)
        reported = {report["replica"] for report in status_of(ray_server)["replicas"]["reports"]}
        # Serve's count, two live replica processes (the replacement's process title is set a moment after
        # Serve counts it), and the dead replica's figures gone.
        now = replica_pids()
        up = ready.status_code == 200 and ready.json()["replicas"]["up"] == 2
        if up and pids[victim] not in now and len(now) == 2 and victim not in reported:
            break
        assert time.monotonic() < deadline, (ready.text, now, reported)
        time.sleep(1)
    # The replacement serves, and its state cache builds up again: a state it owns misses, then hits.
    for n in range(40):
        state = f"After the restart, case {n}: a late delivery and a missing invoice. " * 3
        first = decide(url, state, "late")
        replacement = first.headers["x-clef-replica"]
        if replacement not in (victim, survivor):
            break
    else:
        pytest.fail("no state went to the replacement replica")
    second = decide(url, state, "late")
    assert (first.headers["x-clef-state-cache"], second.headers["x-clef-state-cache"]) == ("miss", "hit")
    assert second.headers["x-clef-replica"] == replacement


def test_sigterm_stops_every_process_it_started_and_its_replicas_spans_join_the_callers_trace(
    ray_server: RayServer, otlp_receiver: tuple[str, Received]
) -> None:
    # Runs last in this module (pytest keeps file order): the fixture's server goes away here.
    traced = httpx.post(
        ray_server.url + "/v1/systemone", json=REQUEST, headers={"traceparent": TRACEPARENT}, timeout=240
    )
    assert traced.status_code == 200, traced.text
    ray_server.process.send_signal(signal.SIGTERM)
    assert ray_server.process.wait(120) == 0
    deadline = time.monotonic() + 60
    while ray_processes():
        assert time.monotonic() < deadline, ray_processes()
        time.sleep(1)
    log = ray_server.log_text()
    assert "clef_runtime.scale: stopped" in log
    assert "graceful_shutdown failed" not in log and "did not stop cleanly" not in log
    assert "\x1b[" not in log
    _check_trace_across_processes(otlp_receiver[1].spans, traced.headers["x-clef-replica"])


def _check_trace_across_processes(spans: list[Span], replica: str) -> None:
    """The ingress's request span is the caller's span's child; the replica's span is the request span's
    child, in the same trace (exactly: a context that did not reach the replica would leave its span in a
    trace of its own, or none); the replica's queue, steps and head are its children, inside it."""
    (ingress,) = [s for s in spans if s.trace_id.hex() == TRACE_ID and s.name == "POST /v1/systemone"]
    assert ingress.parent_span_id.hex() == PARENT_ID
    on_replicas = [s for s in spans if s.name == "clef.replica" and s.trace_id.hex() == TRACE_ID]
    (on_replica,) = on_replicas
    assert on_replica.parent_span_id == ingress.span_id
    assert _attributes(on_replica.attributes)["clef.replica"] == replica
    # Clocks of one machine: the replica's span lies inside the ingress's.
    assert ingress.start_time_unix_nano <= on_replica.start_time_unix_nano
    assert on_replica.end_time_unix_nano <= ingress.end_time_unix_nano
    engine = [s for s in spans if s.parent_span_id == on_replica.span_id]
    assert {s.name for s in engine} == {"clef.queue", "clef.step", "clef.head"}
    assert all(s.trace_id.hex() == TRACE_ID for s in engine)
    check_engine_spans(on_replica, engine)
