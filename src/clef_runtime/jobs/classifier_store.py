"""Saved classifiers in SQLite (the standard library's sqlite3, WAL): a name, per owner, for a set of System
One questions plus the head that answers them.

A classifier is a definition, not work: several servers may share one file (each write is one short
``BEGIN IMMEDIATE`` transaction, and SQLite serialises writers across processes), so unlike the jobs
database there is no owning process and no lock file. A replace reads and bumps the version inside the
transaction that writes it, so concurrent replaces of one name, from any number of threads or processes,
each get their own version and none is lost.

Versions only grow: deleting a classifier keeps a tombstone (its owner, name and last version; the
questions, head and description are erased), and creating the name again continues from there. So
``(name, version)``, which every answer reports, always identifies one definition.

The file is ours only if its ``application_id`` says so: a damaged or foreign file is refused at open with
:class:`ClassifierStoreError` (the server does not start on it). A file SQLite cannot open or write
(read-only, locked) does not stop anything: a call that needs it raises :class:`ClassifierStoreUnavailable`
(the routes answer 503, the decision routes go on), and a file that could not be opened is tried again at
the next call.

No HTTP here: the routes (`clef_runtime.server.classifiers.routes`) validate the questions before they
are stored, and own the mapping of a key to its owner id.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "APPLICATION_ID",
    "Classifier",
    "ClassifierStore",
    "ClassifierStoreError",
    "ClassifierStoreUnavailable",
]

logger = logging.getLogger("clef_runtime.server")

#: ``PRAGMA application_id`` of a clef-runtime classifiers database ("CLFC").
APPLICATION_ID = 0x434C4643
SCHEMA_VERSION = 2
"""2 added ``head_digest`` (the digest of the head a classifier was saved with); a version-1 file is
migrated in place when opened, its classifiers without one (deciding asks for a PUT to pin them)."""

_SCHEMA = """
CREATE TABLE classifiers (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    version INTEGER NOT NULL,
    questions TEXT,
    head TEXT,
    head_digest TEXT,
    description TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, name)
) WITHOUT ROWID
"""


class ClassifierStoreError(RuntimeError):
    """The database cannot be used: damaged, foreign, or of an unknown schema version. Raised at open, so the
    server refuses to start instead of overwriting someone else's file."""


class ClassifierStoreUnavailable(RuntimeError):
    """A read or write failed at run time (disk full, read-only file, busy past the timeout): the classifier
    routes answer 503, the other routes are unaffected."""


@dataclass(frozen=True)
class Classifier:
    """One saved classifier, as the API reports it (``owner`` never leaves the server)."""

    owner: str
    name: str
    version: int
    questions: dict[str, Any]
    head: str | None
    description: str | None
    created_at: float
    updated_at: float
    head_digest: str | None = None
    """The digest of the head it answers with, as served when it was saved (None: saved before digests were
    recorded); deciding is refused while the head served under that name has another digest."""

    def as_api(self) -> dict[str, Any]:
        """The body of ``GET /v1/classifiers/{name}``."""
        return {
            "name": self.name,
            "version": self.version,
            "questions": self.questions,
            "head": self.head,
            "head_digest": self.head_digest,
            "description": self.description,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
        }


def _iso(stamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamp)) + f".{int(stamp % 1 * 1000):03d}Z"


class ClassifierStore:
    """Classifiers in one SQLite file. Thread-safe (one connection behind a lock; every call is short)."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = 10.0) -> None:
        """Open (or create) the database at ``path``. Raises :class:`ClassifierStoreError` for a damaged or
        foreign file, or a directory that cannot be made. A file SQLite cannot open or create now (read-only,
        locked) does not raise: every call raises :class:`ClassifierStoreUnavailable` until it can."""
        self.path = Path(path)
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        self._closed = False
        try:
            self._connection()
        except ClassifierStoreUnavailable as exc:
            # Startup must not depend on this file: decisions go on, the classifier routes answer 503.
            logger.warning("saved classifiers are unavailable until the file can be opened: %s", exc)

    def _connection(self) -> sqlite3.Connection:
        """The open connection, opening the file first when it is not open yet (call with the lock held, or
        from ``__init__``). Raises :class:`ClassifierStoreError` (damaged or foreign file, OS error) or
        :class:`ClassifierStoreUnavailable` (closed, or SQLite cannot open or write the file now)."""
        if self._closed:
            raise ClassifierStoreUnavailable(f"the classifiers database {self.path} is closed")
        if self._db is not None:
            return self._db
        db: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existed = self.path.exists() and self.path.stat().st_size > 0
            # timeout: how long a write waits for another process's transaction (SQLite's busy handler).
            db = sqlite3.connect(
                self.path, check_same_thread=False, isolation_level=None, timeout=self._busy_timeout_s
            )
            db.row_factory = sqlite3.Row
            _prepare(db, existed)
        except BaseException as exc:
            if db is not None:
                db.close()
            if isinstance(exc, sqlite3.OperationalError):  # read-only, cannot create, locked: may pass
                raise ClassifierStoreUnavailable(
                    f"the classifiers database {self.path} cannot be opened now: {exc}"
                ) from None
            if isinstance(exc, sqlite3.DatabaseError):
                raise ClassifierStoreError(
                    f"the classifiers database {self.path} cannot be used ({exc}); it is damaged or not a "
                    "clef-runtime classifiers database: move it away (nothing was changed) or point "
                    "--classifiers-db elsewhere"
                ) from None
            if isinstance(exc, OSError):
                raise ClassifierStoreError(
                    f"the classifiers database {self.path} cannot be opened: {exc}"
                ) from None
            raise
        self._db = db
        return db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")  # the write lock now: a read-then-write cannot interleave
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._connection()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except (sqlite3.DatabaseError, ClassifierStoreError) as exc:
            # OperationalError (busy, read-only, disk full) is a DatabaseError; a file found damaged while
            # the server runs fails the call, not the server.
            raise ClassifierStoreUnavailable(f"the classifiers database {self.path} failed: {exc}") from None

    def close(self) -> None:
        """Close the connection; every later call raises :class:`ClassifierStoreUnavailable`."""
        with self._lock:
            self._closed = True
            if self._db is not None:
                self._db.close()
                self._db = None

    # ----------------------------------------------------------------------------------------- writes

    def put(
        self,
        owner: str,
        name: str,
        *,
        questions: dict[str, Any],
        head: str | None,
        head_digest: str | None,
        description: str | None,
    ) -> tuple[Classifier, bool]:
        """Create or replace ``owner``'s classifier ``name``: version 1 for a new name, the stored version
        plus one otherwise (a deleted name continues its versions). Returns ``(classifier, created)``.
        Raises :class:`ClassifierStoreUnavailable` when the write fails."""
        text = json.dumps(questions, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        now = time.time()
        with self._guard(), self._transaction() as db:
            row = db.execute(
                "SELECT version, deleted FROM classifiers WHERE owner = ? AND name = ?", (owner, name)
            ).fetchone()
            if row is None:
                created = True
                db.execute(
                    "INSERT INTO classifiers (owner, name, version, questions, head, head_digest, "
                    "description, created_at, updated_at) VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?)",
                    (owner, name, text, head, head_digest, description, now, now),
                )
            else:
                created = bool(row["deleted"])
                db.execute(
                    "UPDATE classifiers SET version = version + 1, questions = ?, head = ?, "
                    "head_digest = ?, description = ?, updated_at = ?, "
                    "created_at = CASE WHEN deleted THEN ? ELSE created_at END, deleted = 0 "
                    "WHERE owner = ? AND name = ?",
                    (text, head, head_digest, description, now, now, owner, name),
                )
            record = self._get_locked(owner, name)
        assert record is not None
        return record, created

    def delete(self, owner: str, name: str) -> Classifier | None:
        """Delete ``owner``'s classifier ``name``, keeping only its name and version (a tombstone). Returns
        what was deleted, or None when there was no such classifier."""
        with self._guard(), self._transaction() as db:
            record = self._get_locked(owner, name)
            if record is None:
                return None
            db.execute(
                "UPDATE classifiers SET deleted = 1, questions = NULL, head = NULL, head_digest = NULL, "
                "description = NULL, "
                "updated_at = ? WHERE owner = ? AND name = ?",
                (time.time(), owner, name),
            )
        return record

    # ------------------------------------------------------------------------------------------ reads

    def _get_locked(self, owner: str, name: str) -> Classifier | None:
        row = (
            self._connection()
            .execute("SELECT * FROM classifiers WHERE owner = ? AND name = ? AND deleted = 0", (owner, name))
            .fetchone()
        )
        return None if row is None else _record(row)

    def get(self, owner: str, name: str) -> Classifier | None:
        """``owner``'s classifier ``name``, or None (another owner's is None too)."""
        with self._guard(), self._reading():
            return self._get_locked(owner, name)

    def list(self, owner: str) -> list[Classifier]:
        """``owner``'s classifiers, by name."""
        with self._guard(), self._reading() as db:
            rows = db.execute(
                "SELECT * FROM classifiers WHERE owner = ? AND deleted = 0 ORDER BY name", (owner,)
            ).fetchall()
        return [_record(row) for row in rows]


def _prepare(db: sqlite3.Connection, existed: bool) -> None:
    """Check a file that existed is ours (raises ``sqlite3.DatabaseError`` when not), or create the schema."""
    if existed:
        if db.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
            raise sqlite3.DatabaseError("application_id is not clef-runtime's classifiers'")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (1, SCHEMA_VERSION):
            raise sqlite3.DatabaseError(f"schema version {version}, this release reads {SCHEMA_VERSION}")
        if version == 1:
            _migrate_to_2(db)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")  # a saved classifier survives a power cut, not only a crash
    if existed:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        # Two servers creating the file at once: the second finds the table made by the first.
        if db.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
            db.execute(_SCHEMA)
            db.execute(f"PRAGMA application_id={APPLICATION_ID}")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _migrate_to_2(db: sqlite3.Connection) -> None:
    """Add ``head_digest`` to a version-1 file, once even when two servers open it at the same time."""
    db.execute("BEGIN IMMEDIATE")
    try:
        if db.execute("PRAGMA user_version").fetchone()[0] == 1:
            db.execute("ALTER TABLE classifiers ADD COLUMN head_digest TEXT")
            db.execute("PRAGMA user_version=2")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _record(row: sqlite3.Row) -> Classifier:
    return Classifier(
        owner=row["owner"],
        name=row["name"],
        version=row["version"],
        questions=json.loads(row["questions"]),
        head=row["head"],
        head_digest=row["head_digest"],
        description=row["description"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
