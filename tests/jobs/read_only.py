"""Open jobs databases read-only in a test, as SQLite opens a file the process may not write.

Tests may run as root, where ``chmod 0o444`` does not stop writes: SQLite's ``mode=ro`` gives the same
read-only connection (SQLite falls back to it by itself for a file it cannot write).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest


def open_read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on in this test, every ``sqlite3.connect(path)`` opens ``path`` read-only."""
    connect = sqlite3.connect

    def read_only(database: str | Path, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        return connect(f"{Path(database).resolve().as_uri()}?mode=ro", *args, uri=True, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", read_only)
