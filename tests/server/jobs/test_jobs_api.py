"""/v1/jobs over HTTP with the fake engine: submit, status, results, cancel, list, keys, limits, failures."""

from __future__ import annotations

import gzip
import json
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from devtools.fake_engine import FAIL_MARKER, FakeClef, GatedEngine
from fastapi.testclient import TestClient

from clef_runtime.jobs.store import JobLine, JobStore
from clef_runtime.server.jobs.service import job_model
from tests.jobs.read_only import open_read_only
from tests.server.conftest import Served

NOUL = {"type": "noul"}
CHOICE = {"type": "choice", "criteria": {"a": "first", "b": None}}


def request_line(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "custom_id": f"c{i}",
        "state": f"ticket number {i}",
        "questions": {"q": NOUL, "k": CHOICE},
        **extra,
    }


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(row) for row in rows) + "\n").encode()


@pytest.fixture
def jobs_app(serve_fake: Callable[..., Served], tmp_path: Path) -> Callable[..., Served]:
    def start(**overrides: Any) -> Served:
        return serve_fake(jobs_db=str(tmp_path / "jobs.sqlite3"), **overrides)

    return start


def wait_done(client: httpx.Client, job_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        if job["status"] in ("completed", "cancelled"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.02)


def results(client: TestClient, job_id: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    response = client.get(f"/v1/jobs/{job_id}/results", headers=headers)
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/jsonl")
    return [json.loads(line) for line in response.text.splitlines()]


def test_a_job_answers_every_line_like_the_interactive_route(jobs_app: Callable[..., Served]) -> None:
    served = jobs_app()
    client = served.client
    rows = [request_line(i) for i in range(12)]
    created = client.post("/v1/jobs", content=jsonl(rows))
    assert created.status_code == 202
    job = created.json()
    assert job["status"] == "queued" and job["counts"] == {"total": 12, "done": 0, "failed": 0}
    assert job["id"].startswith("job_") and job["created_at"].endswith("Z")
    done = wait_done(client, job["id"])
    assert done["counts"] == {"total": 12, "done": 12, "failed": 0} and done["progress"] == 1.0
    got = results(client, job["id"])
    assert [r["line"] for r in got] == list(range(1, 13))
    assert [r["custom_id"] for r in got] == [f"c{i}" for i in range(12)]
    for row, result in zip(rows, got, strict=True):
        body = {k: v for k, v in row.items() if k != "custom_id"}
        one = client.post("/v1/systemone", json=body).json()
        assert result["response"]["answers"] == one["answers"]
        assert result["response"]["usage"] == one["usage"]


def test_invalid_lines_are_refused_with_their_numbers(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    body = jsonl([request_line(0)]) + b"not json\n\n" + jsonl([{"state": "x", "questions": {}}])
    response = client.post("/v1/jobs", content=body)
    assert response.status_code == 422
    detail = response.json()
    assert detail["invalid_lines"] == 2
    assert {tuple(item["loc"][:3]) for item in detail["detail"]} == {("body", "line", 2), ("body", "line", 4)}
    assert client.get("/v1/jobs").json()["data"] == []  # nothing was stored


def test_skip_invalid_records_them_as_failed(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    body = jsonl([request_line(0)]) + b'{"custom_id": "bad", "state": 5, "questions": {}}\n'
    job = client.post("/v1/jobs?skip_invalid=true", content=body).json()
    done = wait_done(client, job["id"])
    assert done["counts"] == {"total": 2, "done": 1, "failed": 1}
    got = results(client, job["id"])
    assert "response" in got[0] and got[1]["custom_id"] == "bad" and got[1]["error"]["detail"]


@pytest.mark.parametrize("query", ["", "?skip_invalid=true"])
def test_a_repeated_custom_id_refuses_the_whole_job(jobs_app: Callable[..., Served], query: str) -> None:
    client = jobs_app().client
    # Line 3 is blank: lines are numbered as in the file. Line 2 is an invalid request whose custom_id still
    # counts (its failed result would carry it).
    body = (
        jsonl([request_line(0), {"custom_id": "a-1", "state": 5, "questions": {}}])
        + b"\n"
        + jsonl([request_line(2), request_line(3, custom_id="a-1")])
    )
    response = client.post(f"/v1/jobs{query}", content=body)
    assert response.status_code == 422
    assert response.json()["detail"] == [
        {
            "loc": ["body", "line", 5, "custom_id"],
            "msg": "custom_id 'a-1' repeats line 2's",
            "type": "value_error",
        }
    ]
    assert client.get("/v1/jobs").json()["data"] == []  # refused up front: nothing stored, nothing run


def test_distinct_absent_and_invalid_custom_ids_do_not_clash(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    no_id = {"state": "no id", "questions": {"q": NOUL}}
    bad_id = {"custom_id": "", "state": "empty id", "questions": {"q": NOUL}}  # invalid: never a clash
    body = jsonl([request_line(0), no_id, request_line(1), no_id, bad_id, bad_id])
    job = client.post("/v1/jobs?skip_invalid=true", content=body)
    assert job.status_code == 202
    assert wait_done(client, job.json()["id"])["counts"] == {"total": 6, "done": 4, "failed": 2}


def test_a_line_the_engine_fails_is_failed_and_the_rest_go_on(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    rows = [request_line(0), {"state": FAIL_MARKER, "questions": {"q": NOUL}}, request_line(2)]
    job = client.post("/v1/jobs", content=jsonl(rows)).json()
    done = wait_done(client, job["id"])
    assert done["counts"] == {"total": 3, "done": 2, "failed": 1}
    got = results(client, job["id"])
    assert got[1]["error"]["type"] == "internal_error" and "response" in got[2]


def test_compressed_bodies_are_accepted(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    body = gzip.compress(jsonl([request_line(i) for i in range(3)]))
    response = client.post("/v1/jobs", content=body, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 202 and response.json()["counts"]["total"] == 3


def test_idempotency_key(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    body = jsonl([request_line(0)])
    first = client.post("/v1/jobs", content=body, headers={"Idempotency-Key": "k1"})
    again = client.post("/v1/jobs", content=body, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 202 and again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = client.post("/v1/jobs", content=jsonl([request_line(1)]), headers={"Idempotency-Key": "k1"})
    assert other.status_code == 409
    assert len(client.get("/v1/jobs").json()["data"]) == 1


def test_jobs_are_private_to_the_key_that_created_them(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app(api_keys=("alice", "bob")).client
    alice, bob = {"Authorization": "Bearer alice"}, {"X-API-Key": "bob"}
    assert client.post("/v1/jobs", content=jsonl([request_line(0)])).status_code == 401
    job = client.post("/v1/jobs", content=jsonl([request_line(0)]), headers=alice).json()
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).status_code == 200
    for path in (f"/v1/jobs/{job['id']}", f"/v1/jobs/{job['id']}/results"):
        assert client.get(path, headers=bob).status_code == 404
    assert client.delete(f"/v1/jobs/{job['id']}", headers=bob).status_code == 404
    assert client.get("/v1/jobs", headers=bob).json()["data"] == []
    assert [j["id"] for j in client.get("/v1/jobs", headers=alice).json()["data"]] == [job["id"]]


def test_cancel_keeps_finished_lines(jobs_app: Callable[..., Served]) -> None:
    served = jobs_app(engine=FakeClef(delay_s=0.05))
    client = served.client
    job = client.post("/v1/jobs", content=jsonl([request_line(i) for i in range(200)])).json()
    while client.get(f"/v1/jobs/{job['id']}").json()["counts"]["done"] == 0:
        time.sleep(0.01)
    cancelled = client.delete(f"/v1/jobs/{job['id']}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    finished = wait_done(client, job["id"])
    assert finished["status"] == "cancelled" and 0 < finished["counts"]["done"] < 200
    got = results(client, job["id"])
    assert len(got) == finished["counts"]["done"] and all("response" in r for r in got)
    time.sleep(0.3)  # lines in flight at the cancel are not recorded afterwards
    assert len(results(client, job["id"])) == len(got)


def test_limits(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app(
        jobs_max_lines=3, jobs_max_bytes=4096, jobs_max_active=1, engine=FakeClef(delay_s=0.2)
    ).client
    too_many = client.post("/v1/jobs", content=jsonl([request_line(i) for i in range(4)]))
    assert too_many.status_code == 422 and "--jobs-max-lines" in json.dumps(too_many.json())
    too_big = client.post("/v1/jobs", content=b" " * 5000 + jsonl([request_line(0)]))
    assert too_big.status_code == 413
    assert client.post("/v1/jobs", content=jsonl([request_line(0), request_line(1)])).status_code == 202
    busy = client.post("/v1/jobs", content=jsonl([request_line(2)]))
    assert busy.status_code == 429 and "Retry-After" in busy.headers


def test_a_new_idempotency_key_does_not_pass_the_active_limit_and_a_replayed_one_gets_its_job(
    jobs_app: Callable[..., Served],
) -> None:
    engine = GatedEngine()  # holds the first job's line: the job stays active while the test submits
    client = jobs_app(jobs_max_active=1, engine=engine).client
    body = jsonl([request_line(0)])
    first = client.post("/v1/jobs", content=body, headers={"Idempotency-Key": "k1"})
    try:
        assert first.status_code == 202
        fresh = client.post("/v1/jobs", content=jsonl([request_line(1)]), headers={"Idempotency-Key": "k2"})
        assert fresh.status_code == 429 and "--jobs-max-active" in fresh.json()["detail"]["message"]
        assert fresh.headers["Retry-After"] == "60"
        replayed = client.post("/v1/jobs", content=body, headers={"Idempotency-Key": "k1"})
        assert replayed.status_code == 200 and replayed.json()["id"] == first.json()["id"]
    finally:
        engine.gate.set()
    assert wait_done(client, first.json()["id"])["counts"]["done"] == 1
    assert [j["id"] for j in client.get("/v1/jobs").json()["data"]] == [first.json()["id"]]


def test_jobs_off_disables_the_routes(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app(jobs=False).client
    assert client.post("/v1/jobs", content=jsonl([request_line(0)])).status_code == 404
    assert client.get("/v1/jobs").status_code == 404


def test_an_unwritable_database_fails_jobs_only(jobs_app: Callable[..., Served]) -> None:
    served = jobs_app()
    served.app.state.jobs.store._db.execute("PRAGMA query_only=ON")
    response = served.client.post("/v1/jobs", content=jsonl([request_line(0)]))
    assert response.status_code == 503 and response.json()["detail"]["error_type"] == "jobs_unavailable"
    interactive = served.client.post("/v1/systemone", json={"state": "x", "questions": {"q": NOUL}})
    assert interactive.status_code == 200


def test_a_read_only_database_file_starts_the_server_and_fails_only_the_job_writes(
    serve_fake: Callable[..., Served],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    db = tmp_path / "jobs.sqlite3"
    store = JobStore(db)
    old, _ = store.create(
        "", [JobLine(1, None, json.dumps(request_line(0)))], model=job_model("fake"), body_digest="d"
    )
    store.close()
    with sqlite3.connect(db) as raw:  # a job no server has claimed yet: opening tries to claim it
        raw.execute("UPDATE jobs SET model = NULL, model_ref = NULL")
    open_read_only(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="clef_runtime.jobs"):
        client = serve_fake(jobs_db=str(db)).client
    assert any("stay unclaimed" in r.getMessage() and "readonly" in r.getMessage() for r in caplog.records)
    interactive = client.post("/v1/systemone", json={"state": "x", "questions": {"q": NOUL}})
    assert interactive.status_code == 200
    refused = client.post("/v1/jobs", content=jsonl([request_line(0)]))
    assert refused.status_code == 503 and refused.json()["detail"]["error_type"] == "jobs_unavailable"
    assert refused.headers["Retry-After"] == "30"
    assert [j["id"] for j in client.get("/v1/jobs").json()["data"]] == [old.id]  # reads still work


def test_unknown_job_is_404(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    assert client.get("/v1/jobs/job_nope").status_code == 404
    assert client.get("/v1/jobs/job_nope/results").status_code == 404


def test_a_bad_query_parameter_is_named_in_plain_words(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    for query, message in (
        ("limit=0", "limit must be at least 1, got 0"),
        ("limit=500", "limit must be at most 100, got 500"),
        ("limit=many", "limit must be an integer, got 'many'"),
    ):
        response = client.get(f"/v1/jobs?{query}")
        assert response.status_code == 422
        assert response.json()["detail"] == [
            {"loc": ["query", "limit"], "msg": message, "type": response.json()["detail"][0]["type"]}
        ]


def test_job_lines_are_counted_in_metrics(jobs_app: Callable[..., Served]) -> None:
    client = jobs_app().client
    job = client.post("/v1/jobs", content=jsonl([request_line(0), request_line(1)])).json()
    wait_done(client, job["id"])
    text = client.get("/metrics").text
    assert 'clef_job_lines_total{outcome="done"} 2.0' in text
    assert 'route="/v1/jobs/{job_id}"' in text
