"""``clef jobs`` against a scripted stub of the /v1/jobs routes (standard library, no model): the connection
flags before or after the subcommand, readable ``status`` / ``list`` (``--json`` for the server's object),
``submit --wait`` naming the job as soon as it is accepted, while it still runs, and a refused body
(the server's own validation) reported on one line."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from clef_runtime.cli import main
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.server.errors import validation_body
from clef_runtime.server.jobs.service import parse_job_body
from tests.helpers import JsonHandler, run_cli, stub_server


def job(job_id: str, status: str, done: int, failed: int = 0, total: int = 5) -> dict[str, Any]:
    return {
        "id": job_id,
        "object": "job",
        "status": status,
        "counts": {"total": total, "done": done, "failed": failed},
        "progress": round((done + failed) / total, 4),
        "created_at": "2026-12-01T19:42:00.259Z",
        "started_at": "2026-12-01T19:42:01.000Z" if status != "queued" else None,
        "finished_at": "2026-12-01T19:42:09.500Z" if status == "completed" else None,
    }


class JobsStub(JsonHandler):
    """``job_1``: accepted queued; its status blocks until ``release`` is set, then reads completed."""

    requests: ClassVar[list[tuple[str, str, str | None]]] = []
    release: ClassVar[threading.Event] = threading.Event()
    listing: ClassVar[dict[str, Any]] = {}

    def record(self) -> None:
        self.requests.append((self.command, self.path, self.headers.get("Authorization")))

    def do_POST(self) -> None:
        self.record()
        self.body()
        self.reply(202, job("job_1", "queued", 0))

    def do_GET(self) -> None:
        self.record()
        if self.path.startswith("/v1/jobs?"):
            return self.reply(200, self.listing)
        if not self.release.wait(30):
            return self.reply(500, {"detail": {"message": "the test never released the job"}})
        self.reply(200, job("job_1", "completed", 4, failed=1))


@pytest.fixture
def stub() -> Iterator[str]:
    JobsStub.requests = []
    JobsStub.release = threading.Event()
    JobsStub.listing = {
        "object": "list",
        "data": [job("job_2", "running", 2, total=100), job("job_1", "completed", 4, failed=1)],
        "has_more": True,
        "last_id": "job_1",
    }
    with stub_server(JobsStub) as url:
        yield url


@pytest.mark.parametrize(
    "order",
    [
        ["--url", "{url}", "--api-key", "k", "status", "job_1"],
        ["status", "job_1", "--url", "{url}", "--api-key", "k"],
        [
            "--url",
            "http://127.0.0.1:9",
            "--api-key",
            "old",
            "status",
            "--url",
            "{url}",
            "--api-key",
            "k",
            "job_1",
        ],
    ],
)
def test_connection_flags_go_before_or_after_the_subcommand(stub: str, order: list[str]) -> None:
    JobsStub.release.set()
    done = run_cli("jobs", *(part.format(url=stub) for part in order))
    assert done.returncode == 0, done.stderr
    assert JobsStub.requests == [("GET", "/v1/jobs/job_1", "Bearer k")]  # the later value wins


def test_status_is_readable_and_json_on_request(stub: str) -> None:
    JobsStub.release.set()
    done = run_cli("jobs", "status", "job_1", "--url", stub)
    assert done.returncode == 0, done.stderr
    fields = dict(line.split(None, 1) for line in done.stdout.splitlines())
    assert fields == {
        "id": "job_1",
        "status": "completed",
        "lines": "5 total, 4 done, 1 failed (100% finished)",
        "created": "2026-12-01T19:42:00.259Z",
        "started": "2026-12-01T19:42:01.000Z",
        "finished": "2026-12-01T19:42:09.500Z",
    }
    raw = run_cli("jobs", "status", "job_1", "--url", stub, "--json")
    assert json.loads(raw.stdout) == job("job_1", "completed", 4, failed=1)


def test_list_is_a_table_and_json_on_request(stub: str) -> None:
    done = run_cli("jobs", "list", "--limit", "2", "--url", stub)
    assert done.returncode == 0, done.stderr
    header, first, second, note = done.stdout.splitlines()
    assert header.split() == ["ID", "STATUS", "TOTAL", "DONE", "FAILED", "CREATED"]
    assert first.split() == ["job_2", "running", "100", "2", "0", "2026-12-01T19:42:00.259Z"]
    assert second.split() == ["job_1", "completed", "5", "4", "1", "2026-12-01T19:42:00.259Z"]
    assert header.index("TOTAL") + len("TOTAL") == first.index("100") + len("100")  # counts right-aligned
    assert "more" in note
    assert JobsStub.requests[-1][1] == "/v1/jobs?limit=2"
    raw = run_cli("jobs", "list", "--json", "--url", stub)
    assert json.loads(raw.stdout) == JobsStub.listing
    JobsStub.listing = {"object": "list", "data": [], "has_more": False, "last_id": None}
    assert run_cli("jobs", "list", "--url", stub).stdout == "no jobs\n"


def test_submit_wait_names_the_job_as_soon_as_it_is_accepted(
    stub: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "lines.jsonl"
    source.write_text('{"state": "a", "questions": {"q": {"type": "noul"}}}\n')
    statuses: list[int] = []
    command = threading.Thread(
        target=lambda: statuses.append(main(["jobs", "submit", str(source), "--wait", "--url", stub]))
    )
    command.start()
    err, deadline = "", time.monotonic() + 30
    while "job_1" not in err and time.monotonic() < deadline:
        time.sleep(0.02)
        err += capsys.readouterr().err
    # The job is still running (its status is held back): the id came first, with how to follow it.
    assert command.is_alive() and not JobsStub.release.is_set()
    assert err.startswith("job job_1 accepted: ")
    assert f"clef jobs --url {stub} status job_1 --wait" in err
    JobsStub.release.set()
    command.join(30)
    assert statuses == [0]
    out = capsys.readouterr().out
    assert json.loads(out)["status"] == "completed"


def test_list_limit_out_of_range_is_a_usage_error(stub: str) -> None:
    done = run_cli("jobs", "list", "--limit", "0", "--url", stub)
    assert done.returncode == 2 and "--limit" in done.stderr and JobsStub.requests == []


class ValidatingJobsStub(JsonHandler):
    """POST /v1/jobs validated by the server's own `parse_job_body`, refused with the route's 422 body."""

    def do_POST(self) -> None:
        try:
            parse_job_body(self.body(), max_lines=100)
        except RequestValidationError as exc:
            return self.reply(422, validation_body(exc.errors))
        self.reply(202, job("job_1", "queued", 0))


def test_submit_of_a_repeated_custom_id_is_one_line_naming_the_line_and_the_id(tmp_path: Path) -> None:
    source = tmp_path / "lines.jsonl"
    line = '{"custom_id": "%s", "state": "s", "questions": {"q": {"type": "noul"}}}\n'
    source.write_text(line % "a-1" + line % "b-2" + line % "a-1")
    with stub_server(ValidatingJobsStub) as url:
        done = run_cli("jobs", "submit", str(source), "--url", url)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: body.line.3.custom_id: custom_id 'a-1' repeats line 1's (HTTP 422)\n"
