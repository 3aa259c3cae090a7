"""The classifiers database on its own: versions that only grow, owners kept apart, a file shared by two
stores (two servers) with concurrent replaces losing no version, and damaged or foreign files refused."""

from __future__ import annotations

import ast
import sqlite3
import threading
from pathlib import Path

import pytest

from clef_runtime.jobs import classifier_store
from clef_runtime.jobs.classifier_store import (
    ClassifierStore,
    ClassifierStoreError,
    ClassifierStoreUnavailable,
)
from tests.jobs.read_only import open_read_only

QUESTIONS = {"refund": {"type": "noul", "instructions": "Is a refund requested?"}}


def put(store: ClassifierStore, owner: str = "", name: str = "triage", **fields: object) -> tuple:
    values: dict = {"questions": QUESTIONS, "head": None, "head_digest": None, "description": None, **fields}
    return store.put(owner, name, **values)


def test_a_new_name_is_version_1_and_each_replace_adds_one(tmp_path: Path) -> None:
    store = ClassifierStore(tmp_path / "c.sqlite3")
    first, created = put(store, description="v1")
    assert created and first.version == 1 and first.created_at == first.updated_at
    second, created = put(store, questions={"q": {"type": "noul"}}, head="h", description="v2")
    assert not created and second.version == 2
    assert second.created_at == first.created_at and second.updated_at >= first.updated_at
    assert store.get("", "triage") == second
    assert second.as_api()["questions"] == {"q": {"type": "noul"}}
    store.close()


def test_owners_see_only_their_own_classifiers(tmp_path: Path) -> None:
    store = ClassifierStore(tmp_path / "c.sqlite3")
    put(store, owner="a", name="x")
    put(store, owner="a", name="b-first")
    put(store, owner="b", name="x")
    assert [c.name for c in store.list("a")] == ["b-first", "x"]  # by name
    assert [c.name for c in store.list("b")] == ["x"]
    assert store.get("c", "x") is None and store.delete("c", "x") is None
    store.close()


def test_a_deleted_name_keeps_its_version_and_erases_its_definition(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    store = ClassifierStore(path)
    put(store, description="secret plan")
    put(store)
    deleted = store.delete("", "triage")
    assert deleted is not None and deleted.version == 2
    assert store.get("", "triage") is None and store.list("") == []
    assert store.delete("", "triage") is None
    again, created = put(store)
    assert created and again.version == 3  # (name, version) never names two definitions
    store.delete("", "triage")
    store.close()
    # Only the name and the version survive a delete: the definition is gone from the file.
    db = sqlite3.connect(path)
    row = db.execute("SELECT version, questions, head, description FROM classifiers").fetchone()
    db.close()
    assert row == (3, None, None, None)


def test_two_stores_on_one_file_see_each_others_writes(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    first, second = ClassifierStore(path), ClassifierStore(path)
    put(first, description="from the first")
    assert second.get("", "triage").description == "from the first"
    put(second)
    assert first.get("", "triage").version == 2
    first.close()
    second.close()


def test_concurrent_replaces_from_two_stores_lose_no_version(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    stores = [ClassifierStore(path), ClassifierStore(path)]
    per_thread = 10
    versions: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def replace(store: ClassifierStore) -> None:
        start.wait()
        for _ in range(per_thread):
            record, _ = put(store)
            with lock:
                versions.append(record.version)

    threads = [threading.Thread(target=replace, args=(stores[i % 2],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(versions) == list(range(1, 6 * per_thread + 1))  # each write got its own version
    assert stores[0].get("", "triage").version == 6 * per_thread
    for store in stores:
        store.close()


def test_a_foreign_or_damaged_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.sqlite3"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(ClassifierStoreError, match="not a clef-runtime classifiers database"):
        ClassifierStore(foreign)
    damaged = tmp_path / "damaged.sqlite3"
    damaged.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ClassifierStoreError, match="--classifiers-db"):
        ClassifierStore(damaged)
    assert damaged.read_bytes() == b"this is not a database" * 100


def test_a_file_that_cannot_be_written_is_unavailable_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    existing = tmp_path / "existing.sqlite3"
    store = ClassifierStore(existing)
    put(store)
    store.close()
    open_read_only(monkeypatch)
    read_only = ClassifierStore(existing)
    assert read_only.get("", "triage").version == 1  # reads still work
    with pytest.raises(ClassifierStoreUnavailable, match="readonly"):
        put(read_only)
    missing = ClassifierStore(tmp_path / "missing.sqlite3")  # cannot be created: opens all the same
    with pytest.raises(ClassifierStoreUnavailable, match="cannot be opened now"):
        missing.list("")
    monkeypatch.undo()
    assert missing.list("") == []  # tried again at the next call, and now it can
    put(missing)
    assert missing.get("", "triage").version == 1


def test_a_closed_store_is_unavailable_not_a_crash(tmp_path: Path) -> None:
    store = ClassifierStore(tmp_path / "c.sqlite3")
    store.close()
    with pytest.raises(ClassifierStoreUnavailable):
        store.list("")
    with pytest.raises(ClassifierStoreUnavailable):
        put(store)


def test_the_store_is_the_standard_library_only() -> None:
    # No web framework and nothing of ours: the store can be used (and tested) without a server.
    tree = ast.parse(Path(classifier_store.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert {name.split(".")[0] for name in imported} <= {
        "__future__",
        "json",
        "logging",
        "sqlite3",
        "threading",
        "time",
        "collections",
        "contextlib",
        "dataclasses",
        "pathlib",
        "typing",
    }
