"""Batch jobs survive a killed server: a real server process, SIGKILL mid-job, a restart on the same
database. No line is lost, none is answered twice, a finished line is never computed again; and the
`clef jobs` client against a live server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[3]

# A server process with the fake engine; every engine call appends the custom states it computed to a log
# file (one line per request), so the test can tell what each process actually computed.
SERVE_LOGGING_FAKE = textwrap.dedent(
    """
    import sys
    from clef_runtime.serve_command import configure_logging, serve
    from clef_runtime.server.settings import ServerSettings
    from devtools.fake_engine import FakeClef

    class LoggingFake(FakeClef):
        def decide_encoded(self, items):
            answers = super().decide_encoded(items)
            with open(sys.argv[3], "a") as log:
                for item in items:
                    log.write(str(item.request.state) + "\\n")
            return answers

    configure_logging("info")
    settings = ServerSettings(model="fake", port=int(sys.argv[1]), jobs_db=sys.argv[2])
    sys.exit(serve(settings, engine_factory=lambda s: LoggingFake(delay_s=float(sys.argv[4]))))
    """
)


def start_server(db: Path, log: Path, delay_s: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE_LOGGING_FAKE, str(port), str(db), str(log), str(delay_s)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        assert time.monotonic() < deadline, "server did not become ready"
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


def job_body(n: int) -> bytes:
    rows = [
        {"custom_id": f"c{i}", "state": f"line-{i}", "questions": {"q": {"type": "noul"}}} for i in range(n)
    ]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


@pytest.mark.slow
def test_a_job_resumes_after_sigkill_with_every_line_answered_exactly_once(tmp_path: Path) -> None:
    db, log = tmp_path / "jobs.sqlite3", tmp_path / "computed.log"
    total = 60
    process, url = start_server(db, log, delay_s=0.05)
    try:
        job = httpx.post(url + "/v1/jobs", content=job_body(total), timeout=30).json()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=5).json()["counts"]["done"] < 10:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        stop(process)
    before_lines = log.read_text().splitlines()
    # What the killed process had committed (read straight from the file, as a restart would).
    import sqlite3

    with sqlite3.connect(db) as conn:
        committed = {
            row[0] for row in conn.execute("SELECT line FROM results WHERE job_id = ?", (job["id"],))
        }
    assert 10 <= len(committed) < total

    log.write_text("")
    process, url = start_server(db, log, delay_s=0.0)
    try:
        deadline = time.monotonic() + 60
        while (status := httpx.get(f"{url}/v1/jobs/{job['id']}", timeout=5).json())["status"] != "completed":
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["counts"] == {"total": total, "done": total, "failed": 0}
        got = [json.loads(line) for line in httpx.get(f"{url}/v1/jobs/{job['id']}/results").text.splitlines()]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert [r["line"] for r in got] == list(range(1, total + 1))  # every line, once, in order
    assert [r["custom_id"] for r in got] == [f"c{i}" for i in range(total)]
    after = log.read_text().splitlines()
    # The restarted process computed exactly the lines that had no committed result, each once.
    assert sorted(after) == sorted(f"line-{line - 1}" for line in set(range(1, total + 1)) - committed)
    assert len(before_lines) >= len(committed)


@pytest.mark.slow
def test_the_clef_jobs_client(tmp_path: Path) -> None:
    db, log = tmp_path / "jobs.sqlite3", tmp_path / "computed.log"
    process, url = start_server(db, log, delay_s=0.0)
    cli = [sys.executable, "-m", "clef_runtime.cli", "jobs", "--url", url]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        source = tmp_path / "cases.jsonl"
        source.write_bytes(job_body(5))
        submitted = subprocess.run(
            [*cli, "submit", str(source), "--wait"], capture_output=True, env=env, timeout=60
        )
        assert submitted.returncode == 0, submitted.stderr
        job = json.loads(submitted.stdout)
        assert job["status"] == "completed" and job["counts"]["done"] == 5
        out = tmp_path / "results.jsonl"
        fetched = subprocess.run([*cli, "results", job["id"], "--out", str(out)], env=env, timeout=60)
        assert fetched.returncode == 0
        assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == [
            f"c{i}" for i in range(5)
        ]
        listed = subprocess.run([*cli, "list", "--json"], capture_output=True, env=env, timeout=60)
        assert json.loads(listed.stdout)["data"][0]["id"] == job["id"]
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"state": "x"}\n')
        refused = subprocess.run([*cli, "submit", str(bad)], capture_output=True, env=env, timeout=60)
        assert refused.returncode == 2 and b"line.1.questions" in refused.stderr
        missing = subprocess.run([*cli, "submit", str(tmp_path / "nope.jsonl")], capture_output=True, env=env)
        assert missing.returncode == 2 and b"cannot read" in missing.stderr
        cancelled = subprocess.run([*cli, "cancel", job["id"]], capture_output=True, env=env, timeout=60)
        assert json.loads(cancelled.stdout)["status"] == "completed"  # already finished: unchanged
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


@pytest.mark.slow
def test_a_foreign_database_stops_the_server_with_a_clear_message(tmp_path: Path) -> None:
    db = tmp_path / "not-ours.sqlite3"
    db.write_bytes(b"SQLite format 3\x00" + b"\x00" * 200)
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-c", SERVE_LOGGING_FAKE, str(port), str(db), str(tmp_path / "log"), "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert str(db).encode() in result.stderr and b"Traceback" not in result.stderr
