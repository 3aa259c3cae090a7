"""Durable batch jobs in SQLite (the standard library's sqlite3, WAL).

A job is the lines of one JSONL submission. Every line is stored at submission; every answer (or per-line
error) is committed as it is produced, in its own transaction, keyed by ``(job, line)``. That key makes a
line's result unique: after any crash (``kill -9`` included) the runner resumes a job from the lines that
have no result yet, so no line is lost and none is answered twice.

The file is ours only if its ``application_id`` says so: a damaged or foreign file is refused at open with
:class:`JobStoreError`, never silently reused or overwritten. Writes that fail (a full disk, a read-only
file) raise :class:`JobStoreUnavailable`, which the server maps to 503 while the interactive routes go on.

One process owns a database: opening it takes an exclusive ``flock`` on the sidecar file ``<db>.lock`` (it
holds the owner's pid) for as long as the store is open. Two servers sharing a file would both resume its
jobs, computing lines twice and answering one job with two models; the second is refused with
:class:`JobStoreLocked` instead. The operating system drops the lock when its process dies, so a crashed
server never blocks its restart. On a filesystem that cannot lock (some FUSE, CIFS and NFS mounts) the store
warns and runs unlocked.

Every job records the model it was submitted to (:class:`JobModel`): the runner of a server only takes the
jobs of its own model, so a job is never answered by two models; another model's jobs stay queued until a
server of that model opens the file.

No HTTP and no model runs here (a job only names its model): the server's routes and the runner use this
module.
"""

from __future__ import annotations

# builtins.list: below JobStore.list, a bare `list` in JobStore's annotations names that method.
import builtins
import errno
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

try:
    import fcntl
except ImportError:  # not POSIX: no lock (the platforms clef-runtime serves on have flock)
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "APPLICATION_ID",
    "IdempotencyConflict",
    "JobLine",
    "JobModel",
    "JobRecord",
    "JobStatus",
    "JobStore",
    "JobStoreError",
    "JobStoreLocked",
    "JobStoreUnavailable",
    "LineResult",
    "TooManyActiveJobs",
    "lock_path_of",
    "owner_of",
]

logger = logging.getLogger("clef_runtime.jobs")

#: ``PRAGMA application_id`` of a clef-runtime jobs database ("CLFJ").
APPLICATION_ID = 0x434C464A
#: 2: jobs record their model (``model``, ``model_ref``); a version-1 file is migrated at open.
SCHEMA_VERSION = 2
_MIGRATABLE_VERSIONS = (1,)

JobStatus = Literal["queued", "running", "completed", "cancelled"]

_SCHEMA = """
CREATE TABLE jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    status TEXT NOT NULL,
    total INTEGER NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    idempotency_key TEXT,
    body_digest TEXT NOT NULL,
    seq INTEGER NOT NULL,
    model TEXT,
    model_ref TEXT
);
CREATE UNIQUE INDEX jobs_idempotency ON jobs(owner, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX jobs_owner_seq ON jobs(owner, seq);
CREATE TABLE lines (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    line INTEGER NOT NULL,
    custom_id TEXT,
    request TEXT,
    invalid TEXT,
    PRIMARY KEY (job_id, line)
) WITHOUT ROWID;
CREATE TABLE results (
    job_id TEXT NOT NULL REFERENCES jobs(id),
    line INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    payload TEXT NOT NULL,
    finished_at REAL NOT NULL,
    PRIMARY KEY (job_id, line)
) WITHOUT ROWID;
"""


class JobStoreError(RuntimeError):
    """The database cannot be used: damaged, foreign, or of an unknown schema version (the message says
    which file and what to do). Raised at open, so the server refuses to start instead of losing jobs."""


class JobStoreLocked(JobStoreError):
    """Another process owns the database (it holds the lock): two servers must not share one jobs file."""

    def __init__(self, path: Path, pid: int | None) -> None:
        owner = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(
            f"the jobs database {path} is in use by another clef-runtime server ({owner}); a jobs database "
            "belongs to one server: stop that server, give this one its own database with --jobs-db PATH, "
            "or start it without batch jobs (--jobs off)"
        )
        self.path = path
        self.pid = pid


class JobStoreUnavailable(RuntimeError):
    """A write or read failed at run time (disk full, read-only file, I/O error): the job routes answer 503,
    the interactive routes are unaffected."""


class TooManyActiveJobs(Exception):
    """The owner already has ``limit`` jobs of this model queued or running (HTTP 429)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"{limit} jobs are already queued or running for this key on this model")
        self.limit = limit


class IdempotencyConflict(Exception):
    """The Idempotency-Key was used before with a different body (HTTP 409)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"the Idempotency-Key was already used for job {job_id} with a different body")
        self.job_id = job_id


def owner_of(api_key: str | None) -> str:
    """The owner id of jobs created with ``api_key``: a digest, so keys are never stored ("" when auth is
    off)."""
    if not api_key:
        return ""
    return hashlib.sha256(b"clef-jobs\x00" + api_key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class JobModel:
    """The model a job was submitted to: ``name`` as the API reports it, ``ref`` what identifies its weights
    (a resolved directory, ``repo@revision``). Jobs are matched by ``ref``."""

    name: str
    ref: str

    @property
    def label(self) -> str:
        """The name, with the ref when it says more (``clef-flash (/models/clef-flash)``)."""
        if self.ref in (self.name, "") or self.ref.startswith(self.name + "@"):
            return self.ref or self.name
        return f"{self.name} ({self.ref})"


@dataclass(frozen=True)
class JobLine:
    """One submitted line: its 1-based number, ``custom_id``, the request JSON text (None when invalid) and,
    for a line refused at submission with ``skip_invalid``, the error object as JSON text."""

    line: int
    custom_id: str | None
    request: str | None
    invalid: str | None = None


@dataclass(frozen=True)
class LineResult:
    """The committed outcome of one line: ``ok`` with the System One response, or the error object."""

    line: int
    custom_id: str | None
    ok: bool
    payload: dict[str, Any]


@dataclass(frozen=True)
class JobRecord:
    """A job's status and counts, as the API reports it."""

    id: str
    owner: str
    status: JobStatus
    total: int
    done: int
    failed: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    model: JobModel | None = None
    """The model the job was submitted to (None only for a job no server has claimed since the migration)."""

    @property
    def unfinished(self) -> bool:
        """Queued or running."""
        return self.status in ("queued", "running")

    def as_api(self) -> dict[str, Any]:
        """The ``GET /v1/jobs/{id}`` body."""
        finished = self.done + self.failed
        return {
            "id": self.id,
            "object": "job",
            "model": self.model.name if self.model is not None else None,
            "status": self.status,
            "counts": {"total": self.total, "done": self.done, "failed": self.failed},
            "progress": round(finished / self.total, 4) if self.total else 1.0,
            "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }


def _iso(stamp: float | None) -> str | None:
    if stamp is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamp)) + f".{int(stamp % 1 * 1000):03d}Z"


class JobStore:
    """Jobs, their lines and results in one SQLite file. Thread-safe (one connection behind a lock: SQLite
    serialises writers anyway, and every call is short)."""

    def __init__(self, path: str | Path) -> None:
        """Open (or create) the database at ``path`` and take its lock for as long as the store is open.
        Raises :class:`JobStoreLocked` when another process has it open, :class:`JobStoreError` for a damaged
        or foreign file, or one that cannot be created."""
        self.path = Path(path)
        self._lock = threading.RLock()
        self._owner_fd: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._owner_fd = _take_ownership(self.path)
            existed = self.path.exists() and self.path.stat().st_size > 0
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10)
            self._db.row_factory = sqlite3.Row
            self._open(existed)
        except BaseException as exc:
            db = getattr(self, "_db", None)
            if db is not None:
                db.close()
            self._release_ownership()
            if isinstance(exc, sqlite3.DatabaseError):
                raise JobStoreError(
                    f"the jobs database {self.path} cannot be used ({exc}); it is damaged or not a "
                    "clef-runtime jobs database: move it away (nothing was changed) or point --jobs-db "
                    "elsewhere"
                ) from None
            if isinstance(exc, OSError):
                raise JobStoreError(f"the jobs database {self.path} cannot be opened: {exc}") from None
            raise

    def _open(self, existed: bool) -> None:
        db = self._db
        app_id = db.execute("PRAGMA application_id").fetchone()[0]
        version = SCHEMA_VERSION
        if existed:
            if app_id != APPLICATION_ID:
                raise sqlite3.DatabaseError("application_id is not clef-runtime's")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION and version not in _MIGRATABLE_VERSIONS:
                raise sqlite3.DatabaseError(f"schema version {version}, this release reads {SCHEMA_VERSION}")
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed result survives a power cut too, not only a killed process.
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA foreign_keys=ON")
        if not existed:
            with self._transaction():
                for statement in _SCHEMA.strip().split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA application_id={APPLICATION_ID}")
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        elif version == 1:
            self._upgrade_from_v1()

    def _upgrade_from_v1(self) -> None:
        """Add the model columns: version 1's jobs stay unclaimed (model NULL) until `claim_unbound`."""
        try:
            with self._transaction() as db:
                db.execute("ALTER TABLE jobs ADD COLUMN model TEXT")
                db.execute("ALTER TABLE jobs ADD COLUMN model_ref TEXT")
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.OperationalError as exc:
            # The file is sound (its checks passed): it could not be written, so "damaged" would mislead.
            raise JobStoreError(
                f"the jobs database {self.path} is from an older release and could not be upgraded ({exc}); "
                "is it read-only, or open in another program? Let this server write the file and its "
                "directory and start again (nothing was changed), or point --jobs-db elsewhere"
            ) from None

    def _release_ownership(self) -> None:
        if self._owner_fd is not None:
            os.close(self._owner_fd)  # closing the descriptor drops its flock
            self._owner_fd = None

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            raise JobStoreUnavailable(f"the jobs database {self.path} failed: {exc}") from None
        except sqlite3.DatabaseError as exc:
            raise JobStoreUnavailable(f"the jobs database {self.path} failed: {exc}") from None

    def close(self) -> None:
        """Close the connection and give up the database (another server may open it then)."""
        with self._lock:
            self._db.close()
            self._release_ownership()

    # ----------------------------------------------------------------------------------------- writes

    def create(
        self,
        owner: str,
        lines: Sequence[JobLine],
        *,
        model: JobModel,
        body_digest: str,
        idempotency_key: str | None = None,
        max_active: int | None = None,
    ) -> tuple[JobRecord, bool]:
        """Store a new job of ``model`` with its lines (lines refused at submission get their failed result at
        once).

        With ``idempotency_key``: the same key and body return the existing job (``created`` False); the
        same key with another body raises :class:`IdempotencyConflict`. With ``max_active``: a new job is
        refused with :class:`TooManyActiveJobs` when the owner already has that many of ``model`` queued or
        running (a replayed key still returns its job). Returns ``(job, created)``. Raises
        :class:`JobStoreUnavailable` when the write fails.
        """
        now = time.time()
        with self._guard(), self._transaction() as db:
            if idempotency_key is not None:
                row = db.execute(
                    "SELECT id, body_digest FROM jobs WHERE owner = ? AND idempotency_key = ?",
                    (owner, idempotency_key),
                ).fetchone()
                if row is not None:
                    if row["body_digest"] != body_digest:
                        raise IdempotencyConflict(row["id"])
                    existing = self._get_locked(row["id"])
                    assert existing is not None
                    return existing, False
            # Counted in the write transaction that inserts: two submissions at once cannot both pass.
            if max_active is not None and self._active_locked(owner, model) >= max_active:
                raise TooManyActiveJobs(max_active)
            job_id = "job_" + uuid.uuid4().hex
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0]
            db.execute(
                "INSERT INTO jobs (id, owner, status, total, created_at, idempotency_key, body_digest, seq, "
                "model, model_ref) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
                (job_id, owner, len(lines), now, idempotency_key, body_digest, seq, model.name, model.ref),
            )
            db.executemany(
                "INSERT INTO lines (job_id, line, custom_id, request, invalid) VALUES (?, ?, ?, ?, ?)",
                [(job_id, item.line, item.custom_id, item.request, item.invalid) for item in lines],
            )
            db.executemany(
                "INSERT INTO results (job_id, line, ok, payload, finished_at) VALUES (?, ?, 0, ?, ?)",
                [(job_id, item.line, item.invalid, now) for item in lines if item.invalid is not None],
            )
            if lines and all(item.invalid is not None for item in lines):
                db.execute(
                    "UPDATE jobs SET status = 'completed', started_at = ?, finished_at = ? WHERE id = ?",
                    (now, now, job_id),
                )
            record = self._get_locked(job_id)
        assert record is not None
        return record, True

    def record_result(self, job_id: str, line: int, ok: bool, payload: dict[str, Any]) -> bool:
        """Commit one line's outcome (its own transaction). Returns False when the line already has one (it
        is never overwritten: exactly once) or the job was cancelled. Raises :class:`JobStoreUnavailable`."""
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        with self._guard(), self._transaction() as db:
            status = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if status is None or status["status"] == "cancelled":
                return False
            cursor = db.execute(
                "INSERT OR IGNORE INTO results (job_id, line, ok, payload, finished_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (job_id, line, int(ok), text, time.time()),
            )
            return cursor.rowcount == 1

    def claim_unbound(self, model: JobModel) -> int:
        """Bind the jobs that record no model (submitted before jobs recorded one) to ``model``: the server
        that opens a migrated file first. Returns how many were bound. Writes only when there are such jobs,
        so a read-only or busy file that has none is not written. Raises :class:`JobStoreUnavailable`."""
        with self._guard(), self._lock:
            if self._db.execute("SELECT 1 FROM jobs WHERE model_ref IS NULL LIMIT 1").fetchone() is None:
                return 0
        with self._guard(), self._transaction() as db:
            cursor = db.execute(
                "UPDATE jobs SET model = ?, model_ref = ? WHERE model_ref IS NULL", (model.name, model.ref)
            )
            return int(cursor.rowcount)

    def mark_running(self, job_id: str) -> None:
        """queued -> running (sets started_at once)."""
        with self._guard(), self._transaction() as db:
            db.execute(
                "UPDATE jobs SET status = 'running', started_at = COALESCE(started_at, ?) "
                "WHERE id = ? AND status = 'queued'",
                (time.time(), job_id),
            )

    def finish_if_done(self, job_id: str) -> bool:
        """Mark the job completed when every line has a result. Returns True if it is (now) completed."""
        with self._guard(), self._transaction() as db:
            row = db.execute(
                "SELECT status, total, (SELECT COUNT(*) FROM results WHERE job_id = jobs.id) AS finished "
                "FROM jobs WHERE id = ?",
                (job_id,),
            ).fetchone()
            if row is None or row["status"] == "cancelled":
                return False
            if row["finished"] < row["total"]:
                return False
            if row["status"] != "completed":
                db.execute(
                    "UPDATE jobs SET status = 'completed', finished_at = ? WHERE id = ?",
                    (time.time(), job_id),
                )
            return True

    def cancel(self, job_id: str, owner: str) -> JobRecord | None:
        """Cancel a job that has not finished (finished lines are kept). Returns the job, or None when it
        does not exist for ``owner``."""
        with self._guard(), self._transaction() as db:
            row = db.execute("SELECT status FROM jobs WHERE id = ? AND owner = ?", (job_id, owner)).fetchone()
            if row is None:
                return None
            if row["status"] in ("queued", "running"):
                db.execute(
                    "UPDATE jobs SET status = 'cancelled', finished_at = ? WHERE id = ?",
                    (time.time(), job_id),
                )
            return self._get_locked(job_id)

    # ------------------------------------------------------------------------------------------ reads

    def _get_locked(self, job_id: str) -> JobRecord | None:
        row = self._db.execute(
            "SELECT jobs.*, "
            "(SELECT COUNT(*) FROM results r WHERE r.job_id = jobs.id AND r.ok = 1) AS done, "
            "(SELECT COUNT(*) FROM results r WHERE r.job_id = jobs.id AND r.ok = 0) AS failed "
            "FROM jobs WHERE id = ?",
            (job_id,),
        ).fetchone()
        if row is None:
            return None
        return JobRecord(
            id=row["id"],
            owner=row["owner"],
            status=row["status"],
            total=row["total"],
            done=row["done"],
            failed=row["failed"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            model=JobModel(row["model"] or "", row["model_ref"]) if row["model_ref"] is not None else None,
        )

    def get(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        """The job, or None when it does not exist (or belongs to another owner when ``owner`` is given)."""
        with self._guard(), self._lock:
            record = self._get_locked(job_id)
        if record is None or (owner is not None and record.owner != owner):
            return None
        return record

    def list(self, owner: str, *, limit: int = 20, after: str | None = None) -> tuple[list[JobRecord], bool]:
        """The owner's jobs, newest first, ``limit`` at a time after the job ``after``. Returns (jobs,
        has_more)."""
        with self._guard(), self._lock:
            if after is not None:
                row = self._db.execute(
                    "SELECT seq FROM jobs WHERE id = ? AND owner = ?", (after, owner)
                ).fetchone()
                bound = row["seq"] if row is not None else None
            else:
                bound = None
            if bound is None:
                rows = self._db.execute(
                    "SELECT id FROM jobs WHERE owner = ? ORDER BY seq DESC LIMIT ?", (owner, limit + 1)
                ).fetchall()
            else:
                rows = self._db.execute(
                    "SELECT id FROM jobs WHERE owner = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                    (owner, bound, limit + 1),
                ).fetchall()
            records = [self._get_locked(row["id"]) for row in rows[:limit]]
        return [r for r in records if r is not None], len(rows) > limit

    def active_count(self, owner: str, model: JobModel) -> int:
        """Jobs of ``owner`` for ``model`` that are queued or running (another model's jobs wait for another
        server and take nothing from this one)."""
        with self._guard(), self._lock:
            return self._active_locked(owner, model)

    def _active_locked(self, owner: str, model: JobModel) -> int:
        return int(
            self._db.execute(
                "SELECT COUNT(*) FROM jobs WHERE owner = ? AND model_ref = ? "
                "AND status IN ('queued', 'running')",
                (owner, model.ref),
            ).fetchone()[0]
        )

    def next_lines(self, limit: int, model: JobModel) -> tuple[str, builtins.list[JobLine]] | None:
        """The oldest unfinished job of ``model`` and up to ``limit`` of its lines without a result, in line
        order (what the runner does next), or None when no job of that model has work left."""
        with self._guard(), self._lock:
            jobs = self._db.execute(
                "SELECT id FROM jobs WHERE status IN ('queued', 'running') AND model_ref = ? ORDER BY seq",
                (model.ref,),
            ).fetchall()
            for job in jobs:
                rows = self._db.execute(
                    "SELECT line, custom_id, request FROM lines l WHERE l.job_id = ? AND NOT EXISTS "
                    "(SELECT 1 FROM results r WHERE r.job_id = l.job_id AND r.line = l.line) "
                    "ORDER BY line LIMIT ?",
                    (job["id"], limit),
                ).fetchall()
                if rows:
                    return job["id"], [JobLine(r["line"], r["custom_id"], r["request"]) for r in rows]
        return None

    def unfinished_jobs(self) -> builtins.list[JobRecord]:
        """The jobs queued or running (of every model), oldest first."""
        with self._guard(), self._lock:
            rows = self._db.execute(
                "SELECT id FROM jobs WHERE status IN ('queued', 'running') ORDER BY seq"
            ).fetchall()
            records = [self._get_locked(row["id"]) for row in rows]
        return [record for record in records if record is not None]

    def results(self, job_id: str, *, after_line: int = 0, limit: int = 500) -> builtins.list[LineResult]:
        """Committed results of a job in line order, ``limit`` at a time after ``after_line``."""
        with self._guard(), self._lock:
            rows = self._db.execute(
                "SELECT r.line, l.custom_id, r.ok, r.payload FROM results r JOIN lines l "
                "ON l.job_id = r.job_id AND l.line = r.line WHERE r.job_id = ? AND r.line > ? "
                "ORDER BY r.line LIMIT ?",
                (job_id, after_line, limit),
            ).fetchall()
        return [LineResult(r["line"], r["custom_id"], bool(r["ok"]), json.loads(r["payload"])) for r in rows]


def lock_path_of(path: Path) -> Path:
    """The sidecar file whose lock marks the owner of the database ``path`` (``jobs.sqlite3.lock``), beside
    the file the path resolves to: every symlink or relative spelling of one database shares one lock."""
    resolved = path.resolve()
    return resolved.with_name(resolved.name + ".lock")


#: flock errors of a filesystem that cannot lock at all (some FUSE, CIFS and NFS mounts), not of a lock held.
_NO_LOCKING = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK})


def _take_ownership(path: Path) -> int | None:
    """Take the database's lock (non-blocking) and write this process's pid into the lock file. Returns the
    descriptor that holds it (None where the platform or the filesystem cannot lock). Raises
    :class:`JobStoreLocked` when another open store holds it (in this process or another)."""
    if fcntl is None:
        return None
    lock_path = lock_path_of(path)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _pid_in(fd)
        os.close(fd)
        raise JobStoreLocked(path, pid) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_LOCKING:
            raise
        # Refusing to start would break servers that ran on such mounts before the lock existed.
        logger.warning(
            "cannot lock %s (%s): two servers on this file would not be detected", lock_path, exc.strerror
        )
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)  # the caller never gets the descriptor, so its lock would outlive the failed open
        raise
    return fd


def _pid_in(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None
