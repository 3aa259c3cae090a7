"""Faults the server must survive, beyond tests/server/test_live.py (client disconnects, SIGTERM) and
tests/server/routes/test_conformance.py (the same on the tiny model):

* a worker exception in one request of a batch: that request gets 500 naming its request id, its batch
  mates are retried alone and answered with their own answers;
* a batch too large for memory (MemoryError / torch.OutOfMemoryError from the engine): the batch is split
  and answered; a request that does not fit even alone gets 503 ``overloaded`` with Retry-After, and the
  server keeps serving;
* a missing, truncated or mismatched checkpoint file under ``clef serve``: the process exits 1 with the
  file named, and ``/ready`` is never 200 meanwhile;
* a client that sends its body slowly (slowloris): the engine never waits for it, others are answered;
* a client that goes away while its long request is being computed (the tiny model, chunk by chunk): its
  work stops at the next chunk, well short of its tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from devtools.fake_engine import FAIL_MARKER, FakeClef, GatedEngine

from clef_runtime.model.resolve import resolve_model, tiny_cache_path
from tests.server.conftest import LiveServer, Served, free_port, send_behind_a_held_call
from tests.server.helpers import REQUEST, assert_error_shape, post

REPO = Path(__file__).resolve().parents[2]


def test_a_worker_exception_fails_only_its_request_and_batch_mates_are_retried_alone(
    serve_fake: Callable[..., Served],
) -> None:
    engine = GatedEngine()
    served = serve_fake(engine, max_batch_size=8)
    bodies = [{**REQUEST, "state": f"mate {i}"} for i in range(5)]
    bodies.insert(2, {**REQUEST, "state": f"bad {FAIL_MARKER}"})
    first, responses = send_behind_a_held_call(served, engine, bodies, {**REQUEST, "state": "holder"})
    assert first.status_code == 200
    failing = responses.pop(2)
    detail = assert_error_shape(failing, 500, "internal_error")
    assert detail["request_id"] == failing.headers["x-request-id"] in detail["message"]
    mates = bodies[:2] + bodies[3:]
    for body, response in zip(mates, responses, strict=True):
        assert response.status_code == 200
        assert response.json()["answers"] == FakeClef().decide(body)["answers"]
    states = sorted(body["state"] for body in bodies)  # arrival order is up to the threads
    assert sorted(engine.batches[1]) == states  # they shared one engine call, which failed ...
    assert all(len(batch) == 1 for batch in engine.batches[2:])  # ... and each was retried alone
    assert sorted(batch[0] for batch in engine.batches[2:]) == states
    # The shared call and the failing request's retry alone.
    assert "clef_step_failures_total 2.0" in served.client.get("/metrics").text


class MemoryBoundEngine(GatedEngine):
    """Runs out of memory on any call of more than ``fits`` requests, and on a request whose state
    contains ``HUGE`` even alone; ``error`` is the exception class raised."""

    def __init__(self, error: type[BaseException], fits: int = 1) -> None:
        super().__init__()
        self.error = error
        self.fits = fits

    def decide_encoded(self, items: Any) -> list[dict[str, Any]]:
        states = [str(item.request.state) for item in items]
        if self.first_entered.is_set() and (len(items) > self.fits or any("HUGE" in s for s in states)):
            with self._lock:
                self.batches.append(states)
            raise self.error("out of memory (simulated)")
        return super().decide_encoded(items)


@pytest.mark.parametrize("error", [MemoryError, torch.OutOfMemoryError], ids=["MemoryError", "torch-OOM"])
def test_a_batch_too_large_for_memory_is_split_and_a_request_too_large_alone_is_503(
    serve_fake: Callable[..., Served], error: type[BaseException]
) -> None:
    engine = MemoryBoundEngine(error)
    served = serve_fake(engine, max_batch_size=8)
    bodies = [{**REQUEST, "state": f"row {i}"} for i in range(4)] + [{**REQUEST, "state": "HUGE input"}]
    first, responses = send_behind_a_held_call(served, engine, bodies, {**REQUEST, "state": "holder"})
    assert first.status_code == 200
    for body, response in zip(bodies[:4], responses[:4], strict=True):
        assert response.status_code == 200
        assert response.json()["answers"] == FakeClef().decide(body)["answers"]
    refused = assert_error_shape(responses[4], 503, "overloaded")
    assert "memory" in refused["message"]
    assert responses[4].headers["retry-after"]
    assert len(engine.batches[1]) == 5  # the batch that did not fit
    assert post(served.client, {**REQUEST, "state": "afterwards"}).status_code == 200
    assert 'clef_rejected_requests_total{reason="out_of_memory"} 1.0' in served.client.get("/metrics").text


# ------------------------------------------------------------------------------------ checkpoint faults


def _replace(path: Path, data: bytes) -> None:
    path.unlink()  # a symlink into the shared tiny checkpoint: never write through it
    path.write_bytes(data)


def _missing_shard(directory: Path) -> str:
    (directory / "model-00002-of-00003.safetensors").unlink()
    return "model-00002-of-00003.safetensors"


def _truncated_shard(directory: Path) -> str:
    path = directory / "model-00001-of-00003.safetensors"
    data = path.read_bytes()
    _replace(path, data[: len(data) // 2])
    return "model-00001-of-00003.safetensors"


def _mismatched_head(directory: Path) -> str:
    path = directory / "joint_head_config.json"
    config = json.loads(path.read_text())
    config["width"] *= 2  # the head's tensors no longer have the shapes its config declares
    _replace(path, json.dumps(config).encode())
    return "joint_head.safetensors"


def _swapped_shard(directory: Path) -> str:
    path = directory / "model-00003-of-00003.safetensors"
    _replace(path, (directory / "joint_head.safetensors").read_bytes())
    return "model-00003-of-00003.safetensors"


@pytest.fixture(scope="module")
def tiny_directory() -> Path:
    return resolve_model("tiny").path


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage",
    [_missing_shard, _truncated_shard, _mismatched_head, _swapped_shard],
    ids=["missing", "truncated", "mismatched-head", "swapped-shard"],
)
def test_a_damaged_checkpoint_stops_clef_serve_naming_the_file(
    tmp_path: Path, tiny_directory: Path, damage: Callable[[Path], str]
) -> None:
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_directory, checkpoint, copy_function=os.symlink)
    named = damage(checkpoint)
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("CLEF_")}
    command = [
        sys.executable,
        "-m",
        "clef_runtime.cli",
        "serve",
        "--model",
        str(checkpoint),
        "--port",
        str(port),
    ]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ready_codes: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while process.poll() is None:
            assert time.monotonic() < deadline, "clef serve did not exit"
            with contextlib.suppress(httpx.TransportError):
                ready_codes.append(httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code)
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
    log = process.stdout.read().decode() if process.stdout else ""
    assert process.returncode == 1, log
    assert str(checkpoint / named) in log
    assert 200 not in ready_codes  # never a half-loaded model serving answers
    assert tiny_cache_path().is_dir()  # the shared checkpoint was not touched


def test_while_stopping_accepted_requests_finish_and_new_ones_get_503(
    serve_fake: Callable[..., Served],
) -> None:
    """The drain half of SIGTERM (the signal itself is tested in tests/server/test_live.py): once the
    runtime is stopping, a new request is 503 ``not_ready`` with Retry-After, the accepted one still 200."""
    engine = GatedEngine()
    served = serve_fake(engine)
    runtime = served.app.state.runtime
    with ThreadPoolExecutor(2) as pool:
        accepted = pool.submit(post, served.client, {**REQUEST, "state": "accepted"})
        assert engine.first_entered.wait(10)
        stopping = pool.submit(runtime.stop, 20)
        deadline = time.monotonic() + 10
        while runtime.state != "stopping":
            assert time.monotonic() < deadline
            time.sleep(0.002)
        refused = post(served.client, {**REQUEST, "state": "too late"})
        detail = assert_error_shape(refused, 503, "not_ready")
        assert "shutting down" in detail["message"] and refused.headers["retry-after"]
        engine.gate.set()
        assert accepted.result(20).status_code == 200
        stopping.result(20)
    assert [state for batch in engine.batches for state in batch] == ["accepted"]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _open_post(port: int, body: bytes, send: int) -> socket.socket:
    """A POST /v1/systemone whose headers announce ``body`` whole, with only its first ``send`` bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        "POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body[:send])
    return sock


def test_a_client_sending_its_body_slowly_never_holds_the_engine(
    live_fake: Callable[..., LiveServer],
) -> None:
    live = live_fake(FakeClef())
    body = json.dumps({**REQUEST, "state": "slow client"}).encode()
    slow = _open_post(live.port, body, send=len(body) // 3)
    try:
        with httpx.Client(base_url=live.url, timeout=20) as client:
            # While its body trickles in a byte at a time, the others are answered one after another.
            for i in range(len(body) // 3, len(body) // 2):
                slow.sendall(body[i : i + 1])
                if i % 8 == 0:
                    answer = client.post("/v1/systemone", json={**REQUEST, "state": f"other {i}"})
                    assert answer.status_code == 200
            states = [state for batch in live.engine.batches for state in batch]
            assert states and "slow client" not in states  # never queued: its body is not complete
            assert live.app.state.runtime.queue_depth() == 0
            slow.sendall(body[len(body) // 2 :])
            reply = slow.makefile("rb").readline()
            assert reply.startswith(b"HTTP/1.1 200"), reply  # and once complete it is answered
    finally:
        slow.close()


@pytest.mark.slow
def test_a_client_leaving_mid_compute_stops_its_work_at_the_next_chunk(
    live_fake: Callable[..., LiveServer],
) -> None:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.options import EngineOptions

    engine = Clef.load("tiny", EngineOptions(max_step_tokens=64, cache_mb=0, dtype="fp32"))
    live = live_fake(engine, max_batch_size=1)  # type: ignore[arg-type]
    body = {"state": " ".join(["refund order"] * 4000), "questions": REQUEST["questions"]}
    tokens = engine.encode(body).input_tokens  # about 8,000: over a hundred steps of 64
    with httpx.Client(base_url=live.url, timeout=30) as probe:
        quitter = _open_post(live.port, json.dumps(body).encode(), send=1 << 30)
        # In flight: the request is being computed (it runs, and steps of it have been computed).
        deadline = time.monotonic() + 60
        while True:
            metrics = probe.get("/metrics").text
            if (
                _metric(metrics, "clef_running_requests") == 1
                and _metric(metrics, "clef_step_tokens_sum") >= 256
            ):
                break
            assert time.monotonic() < deadline, "the long request never ran"
            time.sleep(0.01)
        quitter.close()
        deadline = time.monotonic() + 30
        while _metric(probe.get("/metrics").text, "clef_running_requests") != 0:
            assert time.monotonic() < deadline, "the engine kept computing for a client that left"
            time.sleep(0.01)
        computed = _metric(probe.get("/metrics").text, "clef_step_tokens_sum")
        assert _metric(probe.get("/metrics").text, "clef_client_disconnects_total") == 1
        assert 256 <= computed < tokens / 2, (computed, tokens)  # stopped well short of its tokens
        after = probe.post("/v1/systemone", json=REQUEST)
        assert after.status_code == 200  # the engine serves on
