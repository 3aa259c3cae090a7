"""The SQLite job store: durable lines and results, exactly-once results, idempotency, ownership, damage."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from clef_runtime.jobs.store import (
    IdempotencyConflict,
    JobLine,
    JobStore,
    JobStoreError,
    JobStoreUnavailable,
    owner_of,
)


def lines(n: int) -> list[JobLine]:
    return [JobLine(i, f"c{i}", json.dumps({"state": f"s{i}", "questions": {}})) for i in range(1, n + 1)]


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    return JobStore(tmp_path / "jobs.sqlite3")


def test_a_job_is_stored_with_its_lines_and_runs_in_line_order(store: JobStore) -> None:
    record, created = store.create("", lines(5), body_digest="d")
    assert created and record.status == "queued" and (record.total, record.done, record.failed) == (5, 0, 0)
    job_id, todo = store.next_lines(3)  # type: ignore[misc]
    assert job_id == record.id and [line.line for line in todo] == [1, 2, 3]
    assert todo[0].custom_id == "c1" and json.loads(todo[0].request or "")["state"] == "s1"


def test_a_result_is_recorded_once_and_never_overwritten(store: JobStore) -> None:
    record, _ = store.create("", lines(2), body_digest="d")
    assert store.record_result(record.id, 1, True, {"answers": {"a": 1}})
    assert not store.record_result(record.id, 1, True, {"answers": {"a": 2}})
    assert [r.payload for r in store.results(record.id)] == [{"answers": {"a": 1}}]
    # Line 1 has a result: the runner's next lines skip it.
    assert [line.line for line in store.next_lines(10)[1]] == [2]  # type: ignore[index]


def test_the_job_completes_when_every_line_has_a_result(store: JobStore) -> None:
    record, _ = store.create("", lines(2), body_digest="d")
    store.mark_running(record.id)
    store.record_result(record.id, 1, True, {})
    assert not store.finish_if_done(record.id)
    store.record_result(record.id, 2, False, {"type": "x", "message": "y"})
    assert store.finish_if_done(record.id)
    done = store.get(record.id)
    assert done is not None and (done.status, done.done, done.failed) == ("completed", 1, 1)
    assert done.started_at is not None and done.finished_at is not None
    assert store.next_lines(10) is None


def test_results_survive_reopening_the_file(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    first = JobStore(path)
    record, _ = first.create("", lines(3), body_digest="d")
    first.record_result(record.id, 2, True, {"n": 2})
    first.close()
    again = JobStore(path)
    assert [line.line for line in again.next_lines(10)[1]] == [1, 3]  # type: ignore[index]
    assert [(r.line, r.payload) for r in again.results(record.id)] == [(2, {"n": 2})]


def test_idempotency_same_body_same_job_other_body_conflict(store: JobStore) -> None:
    first, created = store.create("", lines(2), body_digest="a", idempotency_key="k")
    again, created_again = store.create("", lines(2), body_digest="a", idempotency_key="k")
    assert created and not created_again and again.id == first.id
    with pytest.raises(IdempotencyConflict):
        store.create("", lines(2), body_digest="b", idempotency_key="k")
    # Keys are per owner.
    other, created_other = store.create(owner_of("key2"), lines(2), body_digest="b", idempotency_key="k")
    assert created_other and other.id != first.id


def test_jobs_are_visible_to_their_owner_only(store: JobStore) -> None:
    mine, _ = store.create(owner_of("a"), lines(1), body_digest="d")
    assert store.get(mine.id, owner_of("a")) is not None
    assert store.get(mine.id, owner_of("b")) is None
    assert store.cancel(mine.id, owner_of("b")) is None
    assert store.list(owner_of("b"))[0] == []
    assert owner_of("a") != owner_of("b") and owner_of(None) == ""


def test_listing_is_newest_first_and_paginated(store: JobStore) -> None:
    ids = [store.create("", lines(1), body_digest=str(i))[0].id for i in range(5)]
    page, more = store.list("", limit=2)
    assert [r.id for r in page] == ids[::-1][:2] and more
    page2, more2 = store.list("", limit=2, after=page[-1].id)
    assert [r.id for r in page2] == ids[::-1][2:4] and more2
    page3, more3 = store.list("", limit=2, after=page2[-1].id)
    assert [r.id for r in page3] == ids[:1] and not more3


def test_cancel_keeps_finished_lines_and_refuses_new_results(store: JobStore) -> None:
    record, _ = store.create("", lines(3), body_digest="d")
    store.record_result(record.id, 1, True, {"n": 1})
    cancelled = store.cancel(record.id, "")
    assert cancelled is not None and cancelled.status == "cancelled" and cancelled.done == 1
    assert not store.record_result(record.id, 2, True, {"n": 2})
    assert store.next_lines(10) is None
    assert [r.line for r in store.results(record.id)] == [1]


def test_invalid_lines_recorded_at_submission_count_as_failed(store: JobStore) -> None:
    bad = JobLine(2, None, None, json.dumps({"type": "invalid_request_error", "message": "no"}))
    record, _ = store.create("", [lines(1)[0], bad], body_digest="d")
    assert (record.done, record.failed) == (0, 1)
    assert [line.line for line in store.next_lines(10)[1]] == [1]  # type: ignore[index]
    only_bad, _ = store.create("", [bad], body_digest="e")
    assert only_bad.status == "completed"


def test_a_foreign_database_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE mine (x)")
        db.execute("INSERT INTO mine VALUES (42)")
    before = path.read_bytes()
    with pytest.raises(JobStoreError, match="not a clef-runtime jobs database"):
        JobStore(path)
    assert path.read_bytes() == before


def test_a_damaged_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(JobStoreError, match=re.escape(str(path))):
        JobStore(path)


def test_a_full_disk_is_a_clear_unavailable_error(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    # SQLite's own limit on the file size gives exactly the error a full disk gives (SQLITE_FULL).
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count={pages}")
    big = [JobLine(i, None, "x" * 5000) for i in range(1, 50)]
    with pytest.raises(JobStoreUnavailable, match="full"):
        store.create("", big, body_digest="d")
    assert store.list("")[0] == []  # nothing half-written


def test_a_read_only_database_is_a_clear_unavailable_error(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store._db.execute("PRAGMA query_only=ON")  # as a file the process may not write
    with pytest.raises(JobStoreUnavailable, match=r"readonly|read-only|read only"):
        store.create("", lines(1), body_digest="d")
