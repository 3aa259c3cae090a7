"""The SQLite job store: durable lines and results, exactly-once results, idempotency, ownership, damage, one
owning process per file, and jobs bound to the model they were submitted to."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clef_runtime.jobs import store as store_module
from clef_runtime.jobs.store import (
    IdempotencyConflict,
    JobLine,
    JobModel,
    JobStore,
    JobStoreError,
    JobStoreLocked,
    JobStoreUnavailable,
    TooManyActiveJobs,
    lock_path_of,
    owner_of,
)
from tests.jobs.read_only import open_read_only
from tests.serving import REPO

MODEL = JobModel("model-a", "/models/model-a")
OTHER = JobModel("model-b", "/models/model-b")


def lines(n: int) -> list[JobLine]:
    return [JobLine(i, f"c{i}", json.dumps({"state": f"s{i}", "questions": {}})) for i in range(1, n + 1)]


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    return JobStore(tmp_path / "jobs.sqlite3")


def test_a_job_is_stored_with_its_lines_and_runs_in_line_order(store: JobStore) -> None:
    record, created = store.create("", lines(5), model=MODEL, body_digest="d")
    assert created and record.status == "queued" and (record.total, record.done, record.failed) == (5, 0, 0)
    job_id, todo = store.next_lines(3, MODEL)  # type: ignore[misc]
    assert job_id == record.id and [line.line for line in todo] == [1, 2, 3]
    assert todo[0].custom_id == "c1" and json.loads(todo[0].request or "")["state"] == "s1"


def test_a_result_is_recorded_once_and_never_overwritten(store: JobStore) -> None:
    record, _ = store.create("", lines(2), model=MODEL, body_digest="d")
    assert store.record_result(record.id, 1, True, {"answers": {"a": 1}})
    assert not store.record_result(record.id, 1, True, {"answers": {"a": 2}})
    assert [r.payload for r in store.results(record.id)] == [{"answers": {"a": 1}}]
    # Line 1 has a result: the runner's next lines skip it.
    assert [line.line for line in store.next_lines(10, MODEL)[1]] == [2]  # type: ignore[index]


def test_the_job_completes_when_every_line_has_a_result(store: JobStore) -> None:
    record, _ = store.create("", lines(2), model=MODEL, body_digest="d")
    store.mark_running(record.id)
    store.record_result(record.id, 1, True, {})
    assert not store.finish_if_done(record.id)
    store.record_result(record.id, 2, False, {"type": "x", "message": "y"})
    assert store.finish_if_done(record.id)
    done = store.get(record.id)
    assert done is not None and (done.status, done.done, done.failed) == ("completed", 1, 1)
    assert done.started_at is not None and done.finished_at is not None
    assert store.next_lines(10, MODEL) is None


def test_results_survive_reopening_the_file(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    first = JobStore(path)
    record, _ = first.create("", lines(3), model=MODEL, body_digest="d")
    first.record_result(record.id, 2, True, {"n": 2})
    first.close()  # gives the file up: it may be opened again
    again = JobStore(path)
    assert [line.line for line in again.next_lines(10, MODEL)[1]] == [1, 3]  # type: ignore[index]
    assert [(r.line, r.payload) for r in again.results(record.id)] == [(2, {"n": 2})]


def test_idempotency_same_body_same_job_other_body_conflict(store: JobStore) -> None:
    first, created = store.create("", lines(2), model=MODEL, body_digest="a", idempotency_key="k")
    again, created_again = store.create("", lines(2), model=MODEL, body_digest="a", idempotency_key="k")
    assert created and not created_again and again.id == first.id
    with pytest.raises(IdempotencyConflict):
        store.create("", lines(2), model=MODEL, body_digest="b", idempotency_key="k")
    # Keys are per owner.
    other, created_other = store.create(
        owner_of("key2"), lines(2), model=MODEL, body_digest="b", idempotency_key="k"
    )
    assert created_other and other.id != first.id


def test_jobs_are_visible_to_their_owner_only(store: JobStore) -> None:
    mine, _ = store.create(owner_of("a"), lines(1), model=MODEL, body_digest="d")
    assert store.get(mine.id, owner_of("a")) is not None
    assert store.get(mine.id, owner_of("b")) is None
    assert store.cancel(mine.id, owner_of("b")) is None
    assert store.list(owner_of("b"))[0] == []
    assert owner_of("a") != owner_of("b") and owner_of(None) == ""


def test_listing_is_newest_first_and_paginated(store: JobStore) -> None:
    ids = [store.create("", lines(1), model=MODEL, body_digest=str(i))[0].id for i in range(5)]
    page, more = store.list("", limit=2)
    assert [r.id for r in page] == ids[::-1][:2] and more
    page2, more2 = store.list("", limit=2, after=page[-1].id)
    assert [r.id for r in page2] == ids[::-1][2:4] and more2
    page3, more3 = store.list("", limit=2, after=page2[-1].id)
    assert [r.id for r in page3] == ids[:1] and not more3


def test_cancel_keeps_finished_lines_and_refuses_new_results(store: JobStore) -> None:
    record, _ = store.create("", lines(3), model=MODEL, body_digest="d")
    store.record_result(record.id, 1, True, {"n": 1})
    cancelled = store.cancel(record.id, "")
    assert cancelled is not None and cancelled.status == "cancelled" and cancelled.done == 1
    assert not store.record_result(record.id, 2, True, {"n": 2})
    assert store.next_lines(10, MODEL) is None
    assert [r.line for r in store.results(record.id)] == [1]


def test_invalid_lines_recorded_at_submission_count_as_failed(store: JobStore) -> None:
    bad = JobLine(2, None, None, json.dumps({"type": "invalid_request_error", "message": "no"}))
    record, _ = store.create("", [lines(1)[0], bad], model=MODEL, body_digest="d")
    assert (record.done, record.failed) == (0, 1)
    assert [line.line for line in store.next_lines(10, MODEL)[1]] == [1]  # type: ignore[index]
    only_bad, _ = store.create("", [bad], model=MODEL, body_digest="e")
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
        store.create("", big, model=MODEL, body_digest="d")
    assert store.list("")[0] == []  # nothing half-written


def test_a_read_only_database_is_a_clear_unavailable_error(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store._db.execute("PRAGMA query_only=ON")  # as a file the process may not write
    with pytest.raises(JobStoreUnavailable, match=r"readonly|read-only|read only"):
        store.create("", lines(1), model=MODEL, body_digest="d")


# ------------------------------------------------------------------------------------ one owner per file


def test_a_second_store_on_the_same_file_is_refused_naming_the_file_the_owner_and_what_to_do(
    tmp_path: Path,
) -> None:
    path = tmp_path / "jobs.sqlite3"
    owner = JobStore(path)
    record, _ = owner.create("", lines(2), model=MODEL, body_digest="d")
    with pytest.raises(JobStoreLocked) as refused:
        JobStore(path)
    message = str(refused.value)
    assert str(path) in message and f"pid {os.getpid()}" in message
    assert "--jobs-db PATH" in message and "--jobs off" in message
    assert refused.value.pid == os.getpid()
    # The refused open changed nothing; once the owner closes, the file opens with its job.
    assert owner.get(record.id) is not None
    owner.close()
    again = JobStore(path)
    assert [job.id for job in again.unfinished_jobs()] == [record.id]
    again.close()


_HOLD_THE_LOCK = """
import sys, time
from clef_runtime.jobs.store import JobStore
store = JobStore(sys.argv[1])
print("owner", flush=True)
time.sleep(600)
"""


def test_a_killed_owner_leaves_no_lock_behind(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    owner = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_LOCK, str(path)], stdout=subprocess.PIPE, env=env, cwd=REPO
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == b"owner"
        with pytest.raises(JobStoreLocked) as refused:
            JobStore(path)
        assert refused.value.pid == owner.pid
        owner.send_signal(signal.SIGKILL)  # a crash: no close, no cleanup
        owner.wait(30)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(30)
    assert lock_path_of(path).exists()  # the stale file is there, its lock is not
    store = JobStore(path)
    assert lock_path_of(path).read_text().strip() == str(os.getpid())
    store.close()


# ------------------------------------------------------------------------------------- bound to a model


def test_a_job_is_only_handed_to_the_model_it_was_submitted_to(store: JobStore) -> None:
    a_job, _ = store.create("", lines(2), model=MODEL, body_digest="a")
    b_job, _ = store.create("", lines(3), model=OTHER, body_digest="b")
    assert store.get(a_job.id).model == MODEL  # type: ignore[union-attr]
    assert store.get(b_job.id).as_api()["model"] == "model-b"  # type: ignore[union-attr]
    # The older job belongs to another model: model B is given its own job only, and B finishing everything
    # it has never reaches A's job.
    job_id, todo = store.next_lines(10, OTHER)  # type: ignore[misc]
    assert job_id == b_job.id and [line.line for line in todo] == [1, 2, 3]
    for line in todo:
        store.record_result(b_job.id, line.line, True, {})
    assert store.finish_if_done(b_job.id)
    assert store.next_lines(10, OTHER) is None
    assert store.next_lines(10, JobModel("model-a", "/elsewhere/model-a")) is None  # same name, other weights
    assert store.next_lines(10, MODEL)[0] == a_job.id  # type: ignore[index]
    assert [job.id for job in store.unfinished_jobs()] == [a_job.id]


_V1_SCHEMA = """
CREATE TABLE jobs (id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, total INTEGER NOT NULL,
    created_at REAL NOT NULL, started_at REAL, finished_at REAL, idempotency_key TEXT,
    body_digest TEXT NOT NULL, seq INTEGER NOT NULL);
CREATE TABLE lines (job_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, request TEXT, invalid TEXT,
    PRIMARY KEY (job_id, line)) WITHOUT ROWID;
CREATE TABLE results (job_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, payload TEXT NOT NULL,
    finished_at REAL NOT NULL, PRIMARY KEY (job_id, line)) WITHOUT ROWID;
INSERT INTO jobs VALUES ('job_old', '', 'running', 2, 1.0, 1.0, NULL, NULL, 'd', 1);
INSERT INTO lines VALUES ('job_old', 1, NULL, '{}', NULL), ('job_old', 2, NULL, '{}', NULL);
INSERT INTO results VALUES ('job_old', 1, 1, '{}', 1.0);
PRAGMA application_id = 1129072202;
PRAGMA user_version = 1;
"""


def test_a_version_1_file_is_migrated_and_its_jobs_go_to_the_first_model_that_claims_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "jobs.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(_V1_SCHEMA)
    store = JobStore(path)
    old = store.get("job_old")
    assert old is not None and old.model is None and (old.done, old.total) == (1, 2)
    assert store.next_lines(10, MODEL) is None  # unclaimed: no model runs it yet
    assert store.claim_unbound(MODEL) == 1
    assert store.next_lines(10, OTHER) is None
    job_id, todo = store.next_lines(10, MODEL)  # type: ignore[misc]
    assert job_id == "job_old" and [line.line for line in todo] == [2]
    assert store.claim_unbound(OTHER) == 0  # claimed once, for good
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2


def test_a_version_1_file_that_cannot_be_written_is_refused_as_not_upgradable_not_as_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "jobs.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(_V1_SCHEMA)
        db.execute("PRAGMA journal_mode=WAL")  # as version 1 left its files
    before = path.read_bytes()
    open_read_only(monkeypatch)
    with pytest.raises(JobStoreError) as refused:
        JobStore(path)
    message = str(refused.value)
    assert "could not be upgraded" in message and "read-only" in message and str(path) in message
    assert "damaged" not in message
    assert path.read_bytes() == before
    monkeypatch.undo()
    JobStore(path).close()  # the refused open let go of the file


# ------------------------------------------------------------------------------ the active-jobs limit


def test_the_active_limit_refuses_a_new_job_but_returns_a_replayed_one(store: JobStore) -> None:
    first, created = store.create(
        "", lines(1), model=MODEL, body_digest="a", idempotency_key="k1", max_active=1
    )
    assert created
    with pytest.raises(TooManyActiveJobs, match="1 jobs are already queued or running"):
        store.create("", lines(1), model=MODEL, body_digest="b", idempotency_key="k2", max_active=1)
    with pytest.raises(TooManyActiveJobs):
        store.create("", lines(1), model=MODEL, body_digest="c", max_active=1)
    again, created = store.create(
        "", lines(1), model=MODEL, body_digest="a", idempotency_key="k1", max_active=1
    )
    assert (again.id, created) == (first.id, False)
    # Other owners and other models have their own count.
    assert store.create("other", lines(1), model=MODEL, body_digest="d", max_active=1)[1]
    assert store.create("", lines(1), model=OTHER, body_digest="e", max_active=1)[1]
    assert store.active_count("", MODEL) == 1


def test_submissions_racing_at_the_active_limit_create_one_job(store: JobStore) -> None:
    start = threading.Barrier(8)
    outcomes: list[str] = []

    def submit(i: int) -> None:
        start.wait()
        try:
            store.create("", lines(1), model=MODEL, body_digest=str(i), max_active=1)
            outcomes.append("created")
        except TooManyActiveJobs:
            outcomes.append("refused")

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["created"] + ["refused"] * 7
    assert store.active_count("", MODEL) == 1


# ------------------------------------------------------------------- claiming without writing at startup


def test_claiming_a_read_only_file_without_unbound_jobs_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "jobs.sqlite3"
    writer = JobStore(path)
    writer.create("", lines(1), model=MODEL, body_digest="d")
    writer.close()
    open_read_only(monkeypatch)
    store = JobStore(path)
    assert store.claim_unbound(OTHER) == 0
    assert len(store.unfinished_jobs()) == 1  # reads work
    with pytest.raises(JobStoreUnavailable, match="readonly"):
        store.create("", lines(1), model=MODEL, body_digest="e")
    store.close()


def test_claiming_while_another_client_holds_a_write_transaction_does_not_wait(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")  # e.g. the sqlite3 shell in the middle of a change
    try:
        store._db.execute("PRAGMA busy_timeout=0")  # a write would fail at once instead of in 10 s
        assert store.claim_unbound(MODEL) == 0
    finally:
        other.execute("ROLLBACK")
        other.close()
        store.close()


# ------------------------------------------------------------------------------------------- the lock


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOLCK])
def test_a_filesystem_that_cannot_lock_runs_unlocked_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    def cannot_lock(fd: int, operation: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(store_module.fcntl, "flock", cannot_lock)
    path = tmp_path / "jobs.sqlite3"
    with caplog.at_level(logging.WARNING, logger="clef_runtime.jobs"):
        store = JobStore(path)
    (warning,) = [r.getMessage() for r in caplog.records if "cannot lock" in r.getMessage()]
    assert str(lock_path_of(path)) in warning and "two servers on this file would not be detected" in warning
    assert store.create("", lines(1), model=MODEL, body_digest="d")[1]
    store.close()


def test_another_lock_error_still_refuses_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fd: int, operation: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(store_module.fcntl, "flock", broken)
    with pytest.raises(JobStoreError, match="cannot be opened"):
        JobStore(tmp_path / "jobs.sqlite3")


def test_a_failed_pid_write_lets_go_of_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(fd: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    path = tmp_path / "jobs.sqlite3"
    monkeypatch.setattr(store_module.os, "ftruncate", disk_full)
    with pytest.raises(JobStoreError, match="No space left"):
        JobStore(path)
    monkeypatch.undo()
    JobStore(path).close()  # not JobStoreLocked: no descriptor kept the lock


def test_a_symlink_to_the_database_shares_its_lock(tmp_path: Path) -> None:
    real = tmp_path / "data" / "jobs.sqlite3"
    alias = tmp_path / "alias.sqlite3"
    owner = JobStore(real)
    alias.symlink_to(real)
    try:
        assert lock_path_of(alias) == lock_path_of(real)
        with pytest.raises(JobStoreLocked):
            JobStore(alias)
    finally:
        owner.close()
