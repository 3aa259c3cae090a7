"""A jobs database belongs to one server, and a job to the model it was submitted to: a second server on the
same ``--jobs-db`` file refuses to start, servers with the default options on different ports each get their
own database, one whose default database another server holds serves without jobs, and a server of another
model leaves the job queued for its own model."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from devtools.fake_engine import FakeClef
from fastapi.testclient import TestClient

from clef_runtime.jobs.store import JobLine, JobStore, JobStoreLocked
from clef_runtime.model.checkpoint import PINNED_REPO_ID, PINNED_REVISION
from clef_runtime.model.resolve import tiny_cache_path
from clef_runtime.server.jobs.service import JobsService, job_model
from clef_runtime.server.settings import ServerSettings
from tests.server.conftest import Served, build_app
from tests.server.jobs.test_jobs_api import jsonl, results, wait_done
from tests.serving import REPO, ServerProcess, clef_serve_argv, free_port, start_server_process

NOUL = {"type": "noul"}


def test_a_second_server_on_the_same_jobs_database_is_refused(
    serve_fake: Callable[..., Served], tmp_path: Path
) -> None:
    db = tmp_path / "jobs.sqlite3"
    first = serve_fake(jobs_db=str(db))
    with pytest.raises(JobStoreLocked, match="--jobs-db PATH") as refused:
        build_app(ServerSettings(model="other", jobs_db=str(db)), FakeClef())
    assert str(db) in str(refused.value)
    assert (
        first.client.post("/v1/jobs", content=jsonl([{"state": "s", "questions": {"q": NOUL}}])).status_code
        == 202
    )


@pytest.mark.slow  # a fresh `clef serve` process (imports torch)
def test_clef_serve_on_a_database_another_server_owns_exits_1_with_one_clear_line(tmp_path: Path) -> None:
    db = tmp_path / "jobs.sqlite3"
    owner = JobStore(db)  # as a running server holds it
    try:
        command = [sys.executable, "-m", "clef_runtime.cli", "serve", "--model", "tiny"]
        command += ["--port", str(free_port()), "--jobs-db", str(db)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    finally:
        owner.close()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "in use by another" in line]
    assert str(db) in line and "--jobs-db PATH" in line and "--jobs off" in line, line


def test_a_default_jobs_database_another_server_owns_turns_jobs_off_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    settings = ServerSettings(model="fake", port=9000)  # no --jobs-db: the default of port 9000
    owner = JobStore(settings.jobs_db_path)  # as another server holds it
    try:
        with caplog.at_level(logging.INFO):
            app = build_app(settings, FakeClef())
        with TestClient(app) as client:
            assert app.state.runtime.wait_until_loaded(10)
            decided = client.post("/v1/systemone", json={"state": "s", "questions": {"q": NOUL}})
            assert decided.status_code == 200
            assert client.get("/v1/jobs").status_code == 404
    finally:
        owner.close()
    (warning,) = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert warning.startswith("batch jobs are off: the default jobs database")
    assert str(settings.jobs_db_path) in warning and "--jobs-db PATH" in warning


def _data_env(data: Path) -> dict[str, str]:
    """The environment of a `clef serve` process whose default databases are under ``data``, built from
    this run's tiny-model cache."""
    return {"XDG_DATA_HOME": str(data), "CLEF_CACHE_DIR": os.environ["CLEF_CACHE_DIR"], "CLEF_DTYPE": "fp32"}


def _start_default_tiny(port: int, tmp_path: Path) -> ServerProcess:
    """``clef serve --model tiny --port PORT`` and nothing else, its data directory in ``tmp_path``."""
    return start_server_process(
        clef_serve_argv("tiny", port),
        port,
        log_path=tmp_path / f"serve-{port}.log",
        env=_data_env(tmp_path / "data"),
        timeout=300,
    )


def _decide(client: httpx.Client) -> int:
    return client.post("/v1/systemone", json={"state": "s", "questions": {"q": NOUL}}).status_code


@pytest.mark.slow  # two fresh `clef serve` processes (torch, the tiny model)
def test_two_clef_serve_with_default_options_on_one_machine_both_serve_decisions_and_jobs(
    tmp_path: Path,
) -> None:
    first_port = free_port()
    second_port = next(port for port in iter(free_port, None) if port != first_port)
    servers = [_start_default_tiny(first_port, tmp_path)]
    try:
        servers.append(_start_default_tiny(second_port, tmp_path))
        first, second = (httpx.Client(base_url=server.url, timeout=120) for server in servers)
        with first, second:
            assert _decide(first) == _decide(second) == 200
            created = second.post("/v1/jobs", content=jsonl([{"state": "s", "questions": {"q": NOUL}}]))
            assert created.status_code == 202, created.text
            assert wait_done(second, created.json()["id"])["counts"]["done"] == 1
            # One classifiers database for both: what one saves, the other lists.
            saved = first.put("/v1/classifiers/triage", json={"questions": {"q": NOUL}})
            assert saved.status_code == 201, saved.text
            assert [item["name"] for item in second.get("/v1/classifiers").json()["data"]] == ["triage"]
    finally:
        statuses = [server.stop() for server in servers]
    assert statuses == [0, 0], [server.log()[-2000:] for server in servers]
    data = tmp_path / "data" / "clef-runtime"
    for port, server in zip((first_port, second_port), servers, strict=True):
        log = server.log()
        assert f"stored in {data / f'jobs-{port}.sqlite3'}" in log, log
        assert f"saved classifiers stored in {data / 'classifiers.sqlite3'}" in log, log
        assert "batch jobs are off" not in log, log


@pytest.mark.slow  # a fresh `clef serve` process (torch, the tiny model)
def test_clef_serve_whose_default_jobs_database_is_held_serves_without_jobs(tmp_path: Path) -> None:
    port = free_port()
    held = tmp_path / "data" / "clef-runtime" / f"jobs-{port}.sqlite3"
    owner = JobStore(held)  # as a server started with --jobs-db on this file holds it
    try:
        server = _start_default_tiny(port, tmp_path)
        try:
            with httpx.Client(base_url=server.url, timeout=120) as client:
                assert _decide(client) == 200
                assert client.get("/v1/jobs").status_code == 404
        finally:
            assert server.stop() == 0, server.log()
    finally:
        owner.close()
    (line,) = [line for line in server.log().splitlines() if "batch jobs are off" in line]
    assert "WARNING" in line and str(held) in line and "--jobs-db PATH" in line, line


def _line(i: int) -> JobLine:
    return JobLine(i, f"c{i}", json.dumps({"state": f"waiting line {i}", "questions": {"q": NOUL}}))


def test_a_job_is_left_queued_by_another_model_and_resumed_by_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "jobs.sqlite3"
    # What a server of model-a leaves when it stops mid-job: the job recorded for model-a, line 1 answered.
    store = JobStore(db)
    waiting, _ = store.create(
        "", [_line(i) for i in range(1, 7)], model=job_model("model-a"), body_digest="d"
    )
    first = FakeClef(name="model-a").decide(json.loads(_line(1).request or ""))
    store.record_result(waiting.id, 1, True, first)
    store.close()

    engine_b = FakeClef(name="model-b")
    app_b = build_app(ServerSettings(model="model-b", jobs_db=str(db)), engine_b)
    with caplog.at_level(logging.WARNING, logger="clef_runtime.jobs"), TestClient(app_b) as client:
        own = client.post("/v1/jobs", content=jsonl([{"state": "b's own", "questions": {"q": NOUL}}]))
        # The runner takes the oldest job it may run first: model-a's job is older, so B finishing its
        # own job shows it never took model-a's.
        assert wait_done(client, own.json()["id"])["counts"]["done"] == 1
        assert [r["response"]["model"] for r in results(client, own.json()["id"])] == ["model-b"]
        job = client.get(f"/v1/jobs/{waiting.id}").json()
        assert (job["status"], job["model"], job["counts"]["done"]) == ("queued", "model-a", 1)
        assert "model-a" in job["x_waiting_for_model"] and "model-b" in job["x_waiting_for_model"]
        listed = {j["id"]: j for j in client.get("/v1/jobs").json()["data"]}
        assert (
            "x_waiting_for_model" in listed[waiting.id]
            and "x_waiting_for_model" not in listed[own.json()["id"]]
        )
    assert engine_b.batches == [["b's own"]]  # none of model-a's lines was computed by model-b
    assert any("submitted to model model-a, not model-b" in r.getMessage() for r in caplog.records)

    engine_a = FakeClef(name="model-a")
    with TestClient(build_app(ServerSettings(model="model-a", jobs_db=str(db)), engine_a)) as client:
        done = wait_done(client, waiting.id)
        assert (done["status"], done["counts"]["done"]) == ("completed", 6)
        assert "x_waiting_for_model" not in done
        got = results(client, waiting.id)
    assert [r["line"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert {r["response"]["model"] for r in got} == {"model-a"}  # one model answered the whole job
    assert sorted(state for batch in engine_a.batches for state in batch) == [
        f"waiting line {i}" for i in range(2, 7)
    ]  # only the lines without a result, each once


def test_a_submitted_job_records_the_servers_model(jobs_app: Callable[..., Served]) -> None:
    served = jobs_app(model="model-a")
    job = served.client.post("/v1/jobs", content=jsonl([{"state": "s", "questions": {"q": NOUL}}])).json()
    assert job["model"] == "model-a"
    record = served.app.state.jobs.store.get(job["id"])
    assert record.model == job_model("model-a")


@pytest.fixture
def jobs_app(serve_fake: Callable[..., Served], tmp_path: Path) -> Callable[..., Served]:
    def start(**overrides: object) -> Served:
        return serve_fake(jobs_db=str(tmp_path / "jobs.sqlite3"), **overrides)

    return start


def test_the_model_identity_names_the_weights(tmp_path: Path) -> None:
    assert job_model("tiny").ref == tiny_cache_path().name  # the tiny build: its random weights
    directory = tmp_path / "my-model"
    directory.mkdir()
    local = job_model(str(directory))
    assert (local.name, local.ref) == ("my-model", str(directory.resolve()))
    assert job_model(PINNED_REPO_ID).ref == f"{PINNED_REPO_ID.lower()}@{PINNED_REVISION}"
    assert job_model(PINNED_REPO_ID) == job_model(f"{PINNED_REPO_ID}@{PINNED_REVISION}")
    assert job_model("org/other").ref == "org/other@main"
    assert job_model("org/other@v2") != job_model("org/other")
    assert job_model("org/other@v2").name == "org/other"


def test_a_job_submitted_under_another_spelling_of_the_repo_id_is_resumed(tmp_path: Path) -> None:
    # The Hub matches repo ids case-insensitively: both spellings load the same weights.
    db = tmp_path / "jobs.sqlite3"
    store = JobStore(db)
    typed = job_model("Cloudflare/Clef-Flash")
    job, _ = store.create("", [_line(1)], model=typed, body_digest="d")
    store.close()
    restarted = JobStore(db)
    found = restarted.next_lines(10, job_model(PINNED_REPO_ID.lower()))
    restarted.close()
    assert found is not None and found[0] == job.id
    assert (
        typed.ref == f"{PINNED_REPO_ID.lower()}@{PINNED_REVISION}" and typed.name == "Cloudflare/Clef-Flash"
    )
    assert job_model("Org/Other@v2").ref == job_model("org/other@v2").ref == "org/other@v2"


def test_a_failed_startup_lets_go_of_the_jobs_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: JobsService, *args: object, **kwargs: object) -> None:
        raise RuntimeError("the runner could not be built")

    db = tmp_path / "jobs.sqlite3"
    monkeypatch.setattr(JobsService, "__init__", broken)
    with pytest.raises(RuntimeError, match="could not be built"):
        build_app(ServerSettings(model="fake", jobs_db=str(db)), FakeClef())
    monkeypatch.undo()
    JobStore(db).close()  # not JobStoreLocked: the failed server closed the store and its lock


def test_another_models_waiting_jobs_do_not_count_against_the_active_limit(
    jobs_app: Callable[..., Served], tmp_path: Path
) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    store.create("", [_line(1)], model=job_model("model-a"), body_digest="a")
    store.close()
    client = jobs_app(model="model-b", jobs_max_active=1).client
    body = jsonl([{"state": "s", "questions": {"q": NOUL}}])
    own = client.post("/v1/jobs", content=body)
    assert own.status_code == 202, own.text  # model-a's queued job takes nothing from model-b
    wait_done(client, own.json()["id"])
