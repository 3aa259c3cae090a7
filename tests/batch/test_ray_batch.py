"""``clef batch --ray`` on a local Ray head (127.0.0.1) with two `ClefBatchWorker` actors: one of them is
killed while it holds rows; Ray restarts it and retries its batch, and OUTPUT still holds every line
exactly once, with the answers the in-process run gives. Every Ray process is gone afterwards."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from clef_runtime.batch.output import read_output
from tests.batch.processes import processes_with, start_batch
from tests.batch.requests import assert_same_answer, outputs_by_line, ticket_requests, write_jsonl
from tests.helpers import run_cli
from tests.scale.test_ray_serve import one_ray_cluster_at_a_time, ray_processes

pytestmark = pytest.mark.slow

ROWS = 200
STATES = 50
WORKER = b"ray::MapWorker(MapBatches(ClefBatchWorker))"
BUSY = WORKER + b".submit"
"""Ray's process title of an actor while it runs a batch (``.submit`` is Ray Data's task method)."""


def test_a_worker_killed_while_it_holds_rows_loses_none_and_writes_none_twice(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ticket_requests(ROWS, STATES, filler_words=40))
    options = ("--dtype", "fp32", "--batch-rows", "8", "--commit-rows", "50")
    local = run_cli("batch", str(source), str(tmp_path / "local"), *options)
    assert local.returncode == 0, local.stderr

    with one_ray_cluster_at_a_time():
        assert not ray_processes(), "Ray is already running on this machine"
        log = tmp_path / "ray.log"
        process = start_batch(
            str(source), str(tmp_path / "ray"), *options, "--ray", "--replicas", "2", log=log
        )
        try:
            workers: set[int] = set()
            killed = None
            deadline = time.monotonic() + 300
            while killed is None:
                assert process.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no worker got busy"
                found = processes_with(WORKER)
                workers.update(found)
                busy = [pid for pid, title in found.items() if title.endswith(BUSY.decode())]
                if busy and len(found) == 2:
                    killed = busy[0]
                    os.kill(killed, signal.SIGKILL)
                time.sleep(0.02)
            while process.poll() is None:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                workers.update(processes_with(WORKER))
                time.sleep(0.05)
            assert process.returncode == 0, log.read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        deadline = time.monotonic() + 60
        while ray_processes():
            assert time.monotonic() < deadline, f"Ray processes left behind: {ray_processes()}"
            time.sleep(0.5)

    # Ray replaced the killed actor: a third worker process answered after it.
    assert killed in workers and len(workers) >= 3, workers
    summary = json.loads(log.read_text().strip().splitlines()[-1])
    assert (summary["rows"], summary["computed"], summary["errors"]) == (ROWS, ROWS, 0)
    # Each state's 4 rows travel in one batch (grouped by state), so each state is computed once, on one
    # actor: the killed actor's batch, retried on its replacement, computes its states again from scratch.
    assert summary["cache_hits"] == ROWS - STATES
    rows = outputs_by_line(read_output(str(tmp_path / "ray")))
    assert sorted(rows) == list(range(1, ROWS + 1))
    expected = outputs_by_line(read_output(str(tmp_path / "local")))
    for line, row in rows.items():
        assert row.custom_id == expected[line].custom_id
        answers = json.loads(row.response or "")["answers"]
        for question, answer in json.loads(expected[line].response or "")["answers"].items():
            assert_same_answer(answers[question], answer)
