"""``/v1/classifiers`` over HTTP with the fake engine: saving (versions), listing, reading, deleting, a
restart, ownership by API key, deciding exactly as ``/v1/systemone`` does, validation errors naming their
field, the head check, auth, the rate limit, concurrent replaces and the published examples."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from devtools.fake_engine import FakeClef
from fastapi.testclient import TestClient

from clef_runtime.jobs.classifier_store import ClassifierStore, ClassifierStoreError
from clef_runtime.jobs.store import JobStore
from clef_runtime.server.app import create_app
from clef_runtime.server.classifiers.routes import CLASSIFIER_EXAMPLES, DECIDE_EXAMPLES
from clef_runtime.server.classifiers.service import open_store
from clef_runtime.server.settings import ServerSettings
from tests.server.conftest import Served, build_app

QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Is a refund requested?"},
    "team": {"type": "choice", "criteria": {"billing": "charges, refunds", "tech": None}},
    "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
}
TICKET = {"ticket": "Charged twice, please refund today."}


@pytest.fixture
def app_on(serve_fake: Callable[..., Served], tmp_path: Path) -> Callable[..., Served]:
    """``app_on(**settings)``: a fake-engine app on this test's classifiers database."""

    def start(**overrides: Any) -> Served:
        return serve_fake(classifiers_db=str(tmp_path / "classifiers.sqlite3"), **overrides)

    return start


def keyed(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def save(client: TestClient, name: str = "triage", headers: dict[str, str] | None = None, **body: Any) -> Any:
    return client.put(f"/v1/classifiers/{name}", json={"questions": QUESTIONS, **body}, headers=headers or {})


# ------------------------------------------------------------------------------------------------- CRUD


def test_a_put_creates_version_1_and_each_replace_adds_one(app_on: Callable[..., Served]) -> None:
    client = app_on().client
    created = save(client, description="Routes a support ticket.")
    assert created.status_code == 201, created.text
    body = created.json()
    assert set(body) == {
        "name",
        "version",
        "questions",
        "head",
        "head_digest",
        "head_status",
        "description",
        "created_at",
        "updated_at",
    }
    assert (body["name"], body["version"], body["head"]) == ("triage", 1, None)
    assert body["questions"] == QUESTIONS and list(body["questions"]) == list(QUESTIONS)  # order kept
    assert body["description"] == "Routes a support ticket."
    replaced = save(client, questions={"q": {"type": "noul"}})
    assert replaced.status_code == 200
    assert replaced.json()["version"] == 2 and replaced.json()["questions"] == {"q": {"type": "noul"}}
    assert replaced.json()["created_at"] == body["created_at"]
    assert replaced.json()["description"] is None  # a replace is the whole definition
    assert client.get("/v1/classifiers/triage").json() == replaced.json()


def test_the_list_is_by_name_and_a_deleted_classifier_is_a_404(app_on: Callable[..., Served]) -> None:
    client = app_on().client
    assert client.get("/v1/classifiers").json() == {"object": "list", "data": []}
    for name in ("zeta", "alpha", "mid_1"):
        assert save(client, name).status_code == 201
    listed = client.get("/v1/classifiers").json()
    assert [c["name"] for c in listed["data"]] == ["alpha", "mid_1", "zeta"]
    deleted = client.delete("/v1/classifiers/alpha")
    assert deleted.status_code == 200 and deleted.json() == {"name": "alpha", "version": 1, "deleted": True}
    for method, path in (
        ("GET", "/v1/classifiers/alpha"),
        ("DELETE", "/v1/classifiers/alpha"),
        ("POST", "/v1/classifiers/alpha/decide"),
    ):
        response = client.request(method, path, json={"state": "s"})
        assert response.status_code == 404, (method, response.text)
        assert response.json() == {
            "detail": {"error_type": "not_found_error", "message": "no classifier 'alpha' for this key"}
        }
    assert [c["name"] for c in client.get("/v1/classifiers").json()["data"]] == ["mid_1", "zeta"]
    # Saved again, the name continues its versions: (name, version) always names one definition.
    again = save(client, "alpha")
    assert again.status_code == 201 and again.json()["version"] == 2


def test_classifiers_survive_a_restart(app_on: Callable[..., Served]) -> None:
    first = app_on()
    save(first.client, head=None, description="kept")
    save(first.client)
    before = first.client.get("/v1/classifiers/triage").json()
    second = app_on()  # a new app (and jobs database) on the same classifiers file
    assert second.client.get("/v1/classifiers/triage").json() == before
    assert before["version"] == 2
    decided = second.client.post("/v1/classifiers/triage/decide", json={"state": TICKET})
    assert decided.status_code == 200 and decided.json()["x_classifier"] == {"name": "triage", "version": 2}


def test_the_default_database_is_the_users_whatever_the_jobs_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    default = tmp_path / "data" / "clef-runtime" / "classifiers.sqlite3"
    assert ServerSettings(model="m").classifiers_db_path == default
    moved = ServerSettings(model="m", port=9000, jobs_db=str(tmp_path / "elsewhere" / "jobs.sqlite3"))
    assert moved.classifiers_db_path == default
    explicit = ServerSettings(
        model="m", jobs_db=str(tmp_path / "j.db"), classifiers_db=str(tmp_path / "mine.db")
    )
    assert explicit.classifiers_db_path == tmp_path / "mine.db"


def test_classifiers_saved_with_one_jobs_database_are_listed_with_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    first = ServerSettings(model="fake", jobs_db=str(tmp_path / "first" / "jobs.sqlite3"))
    with TestClient(build_app(first, FakeClef())) as client:
        assert save(client).status_code == 201
    # The restart moves --jobs-db (and the port): the classifiers stay where they were.
    second = ServerSettings(model="fake", port=9000, jobs_db=str(tmp_path / "second" / "jobs.sqlite3"))
    with TestClient(build_app(second, FakeClef())) as client:
        listed = client.get("/v1/classifiers").json()["data"]
    assert [(item["name"], item["version"]) for item in listed] == [("triage", 1)]


def test_classifiers_left_beside_a_jobs_database_are_named_at_startup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # What a release that kept classifiers beside --jobs-db left there.
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    former = tmp_path / "mine" / "classifiers.sqlite3"
    ClassifierStore(former).close()
    settings = ServerSettings(model="fake", jobs_db=str(tmp_path / "mine" / "jobs.sqlite3"))
    with caplog.at_level(logging.INFO, logger="clef_runtime.server"):
        open_store(settings).close()
    (warning,) = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert f"--classifiers-db {former}" in warning and str(settings.classifiers_db_path) in warning
    assert f"saved classifiers stored in {settings.classifiers_db_path}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="clef_runtime.server"):
        open_store(dataclasses.replace(settings, classifiers_db=str(former))).close()
    assert [record for record in caplog.records if record.levelno >= logging.WARNING] == []
    assert f"saved classifiers stored in {former}" in caplog.text


def test_concurrent_replaces_over_http_lose_no_version(app_on: Callable[..., Served]) -> None:
    client = app_on().client
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: save(client), range(16)))
    assert sorted(r.json()["version"] for r in responses) == list(range(1, 17))
    assert sorted(r.status_code for r in responses) == [200] * 15 + [201]
    assert client.get("/v1/classifiers/triage").json()["version"] == 16


# ------------------------------------------------------------------------------------------- ownership


def test_another_key_neither_sees_nor_touches_a_classifier(app_on: Callable[..., Served]) -> None:
    client = app_on(api_keys=("alice:key-a", "bob:key-b")).client
    alice, bob = keyed("key-a"), keyed("key-b")
    assert save(client, headers=alice, description="alice's").status_code == 201
    assert client.get("/v1/classifiers", headers=bob).json()["data"] == []
    assert client.get("/v1/classifiers/triage", headers=bob).status_code == 404
    assert client.post("/v1/classifiers/triage/decide", json={"state": "s"}, headers=bob).status_code == 404
    assert client.delete("/v1/classifiers/triage", headers=bob).status_code == 404
    # Bob's classifier of the same name is his own, from version 1; Alice's is untouched.
    bobs = save(client, headers=bob, description="bob's")
    assert bobs.status_code == 201 and bobs.json()["version"] == 1
    alices = client.get("/v1/classifiers/triage", headers=alice).json()
    assert (alices["version"], alices["description"]) == (1, "alice's")
    # The X-API-Key header is the same key, so the same owner.
    assert client.get("/v1/classifiers/triage", headers={"X-API-Key": "key-a"}).json() == alices


def test_every_classifier_route_requires_the_key_when_keys_are_configured(
    app_on: Callable[..., Served],
) -> None:
    client = app_on(api_keys=("secret",)).client
    assert save(client, headers=keyed("secret")).status_code == 201
    for method, path in (
        ("PUT", "/v1/classifiers/triage"),
        ("GET", "/v1/classifiers"),
        ("GET", "/v1/classifiers/triage"),
        ("DELETE", "/v1/classifiers/triage"),
        ("POST", "/v1/classifiers/triage/decide"),
        ("POST", "/v1/classifiers/missing/decide"),
    ):
        for headers in ({}, keyed("wrong")):
            response = client.request(
                method, path, json={"state": "s", "questions": QUESTIONS}, headers=headers
            )
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["detail"]["error_type"] == "authentication_error"
    assert client.get("/v1/classifiers/triage", headers=keyed("secret")).json()["version"] == 1


# ---------------------------------------------------------------------------------------------- deciding


def _without_classifier(response: Any) -> bytes:
    """The response's bytes as the System One route would write them: without ``x_classifier``."""
    body = response.json()
    del body["x_classifier"]
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


@pytest.mark.parametrize(
    ("head", "extra"),
    [(None, {}), ("fraud-v2", {}), (None, {"x_independent": True})],
    ids=["release-head", "tuned-head", "independent"],
)
def test_deciding_answers_the_bytes_systemone_answers(
    app_on: Callable[..., Served], head: str | None, extra: dict[str, Any]
) -> None:
    engine = FakeClef()
    engine.load_head("fraud-v2", "/heads/fraud-v2")
    # Deterministic: no latency in the body, so the two answers can be compared byte for byte.
    served = app_on(engine=engine, deterministic=True)
    client = served.client
    saved = save(client, head=head)
    assert saved.status_code == 201, saved.text
    state = {"ticket": "Charged twice, please refund today.", "images_seen": []}
    decided = client.post("/v1/classifiers/triage/decide", json={"state": state, **extra})
    assert decided.status_code == 200, decided.text
    body = {"state": state, "questions": QUESTIONS, **extra, **({"model": head} if head else {})}
    reference = client.post("/v1/systemone", json=body)
    assert reference.status_code == 200
    assert decided.json()["x_classifier"] == {"name": "triage", "version": 1}
    assert _without_classifier(decided) == reference.content
    assert decided.json()["model"] == (head or engine.name)
    for header in ("x-clef-state-cache", "x-compute-tokens", "x-clef-steps"):
        assert decided.headers[header] == reference.headers[header]


def test_an_image_is_passed_on_and_its_error_points_at_the_classifier_body(
    app_on: Callable[..., Served],
) -> None:
    client = app_on().client
    save(client)
    refused = client.post(
        "/v1/classifiers/triage/decide", json={"state": "photo", "images": ["https://example.com/cat.png"]}
    )
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["loc"] == ["body", "images", 0]


def test_the_decide_route_is_counted_in_the_metrics_by_its_template(app_on: Callable[..., Served]) -> None:
    client = app_on().client
    save(client)
    assert client.post("/v1/classifiers/triage/decide", json={"state": "s"}).status_code == 200
    text = client.get("/metrics").text
    assert 'route="/v1/classifiers/{name}/decide"' in text and 'route="/v1/classifiers/{name}"' in text
    assert 'route="/v1/classifiers/triage' not in text  # templates, never raw names


# ------------------------------------------------------------------------------------------- validation


def _loc(response: Any) -> list[Any]:
    assert response.status_code == 422, response.text
    return response.json()["detail"][0]["loc"]


@pytest.mark.parametrize("name", ["bad.name", "-leading-dash", "x" * 56, "sp ace", "é"])
def test_a_bad_name_is_a_422_naming_the_path_parameter(app_on: Callable[..., Served], name: str) -> None:
    client = app_on().client
    for method, path in (
        ("PUT", f"/v1/classifiers/{name}"),
        ("GET", f"/v1/classifiers/{name}"),
        ("DELETE", f"/v1/classifiers/{name}"),
        ("POST", f"/v1/classifiers/{name}/decide"),
    ):
        response = client.request(method, path, json={"questions": QUESTIONS, "state": "s"})
        assert _loc(response) == ["path", "name"], (method, path)
        assert "classifier name" in response.json()["detail"][0]["msg"]
    assert client.get("/v1/classifiers").json()["data"] == []


def test_the_longest_name_is_accepted(app_on: Callable[..., Served]) -> None:
    assert save(app_on().client, "n" * 55).status_code == 201


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"questions": {"q": {"type": "nope"}}}, ["body", "questions", "q", "type"]),
        (
            {"questions": {"q": {"type": "choice", "criteria": {"only": None}}}},
            ["body", "questions", "q", "criteria"],
        ),
        ({"questions": {}}, ["body", "questions"]),
        ({}, ["body", "questions"]),
        ({"questions": QUESTIONS, "head": 7}, ["body", "head"]),
        ({"questions": QUESTIONS, "head": ""}, ["body", "head"]),
        ({"questions": QUESTIONS, "description": "x" * 2001}, ["body", "description"]),
        ({"questions": QUESTIONS, "descripton": "typo"}, ["body", "descripton"]),
        ([QUESTIONS], ["body"]),
    ],
)
def test_a_bad_definition_is_a_422_naming_the_field_and_stores_nothing(
    app_on: Callable[..., Served], body: Any, loc: list[Any]
) -> None:
    client = app_on().client
    response = client.put("/v1/classifiers/triage", json=body)
    assert _loc(response) == loc
    # The same questions are refused by /v1/systemone at the same place.
    if loc[:2] == ["body", "questions"] and isinstance(body, dict) and "questions" in body:
        assert _loc(client.post("/v1/systemone", json={"state": "s", "questions": body["questions"]})) == loc
    assert client.get("/v1/classifiers/triage").status_code == 404


def test_malformed_json_is_refused_like_everywhere_else(app_on: Callable[..., Served]) -> None:
    client = app_on().client
    response = client.put(
        "/v1/classifiers/triage", content=b'{"questions": ', headers={"Content-Type": "application/json"}
    )
    reference = client.post(
        "/v1/systemone", content=b'{"state": ', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == reference.status_code and 400 <= response.status_code < 500


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({}, ["body", "state"]),
        ({"state": 5}, ["body", "state"]),
        ({"state": "s", "questions": QUESTIONS}, ["body", "questions"]),
        ({"state": "s", "model": "other"}, ["body", "model"]),
        ({"state": "s", "x_independent": "yes"}, ["body", "x_independent"]),
        (["s"], ["body"]),
    ],
)
def test_a_bad_decide_body_is_a_422_naming_the_field(
    app_on: Callable[..., Served], body: Any, loc: list[Any]
) -> None:
    served = app_on()
    save(served.client)
    assert _loc(served.client.post("/v1/classifiers/triage/decide", json=body)) == loc
    assert served.engine.batches == []


def test_a_head_must_be_one_the_server_serves(app_on: Callable[..., Served]) -> None:
    engine = FakeClef()
    engine.load_head("fraud-v2", "/heads/fraud-v2")
    client = app_on(engine=engine).client
    refused = save(client, head="fraud-v3")
    assert _loc(refused) == ["body", "head"]
    message = refused.json()["detail"][0]["msg"]
    assert "unknown head 'fraud-v3'" in message and "fraud-v2" in message and engine.name in message
    assert save(client, head="fraud-v2").json()["head"] == "fraud-v2"
    assert save(client, head=engine.name).json()["head"] == engine.name  # the release head, by name


def test_a_put_waits_for_the_model_and_reads_do_not(tmp_path: Path) -> None:
    loaded = threading.Event()
    engine = FakeClef()

    def slow_load(settings: ServerSettings) -> FakeClef:
        loaded.wait(30)
        return engine

    settings = ServerSettings(
        model="fake",
        jobs_db=str(tmp_path / "jobs.sqlite3"),
        classifiers_db=str(tmp_path / "classifiers.sqlite3"),
    )
    app = create_app(settings, engine_factory=slow_load)
    with TestClient(app) as client:
        # A classifier records its head's digest, known once the model is loaded.
        waiting = save(client)
        assert waiting.status_code == 503 and waiting.headers["retry-after"]
        assert "digest" in waiting.json()["detail"]["message"]
        assert client.get("/v1/classifiers").json()["data"] == []  # reads need no model
        assert client.post("/v1/classifiers/triage/decide", json={"state": "s"}).status_code == 404
        loaded.set()
        assert app.state.runtime.wait_until_loaded(10)
        assert save(client).status_code == 201
        assert client.get("/v1/classifiers/triage").json()["head_status"]["status"] == "ok"


# ------------------------------------------------------------------------------------------- rate limits


def test_a_decide_call_is_charged_once_against_the_callers_rate_limit(app_on: Callable[..., Served]) -> None:
    # A bucket of 4 that refills in 1,000 s: the test never waits for it.
    served = app_on(api_keys=("k",), rate_limit=0.001, rate_burst=4)
    client, key = served.client, keyed("k")
    assert save(client, headers=key).status_code == 201  # 1
    for _ in range(2):  # 2, 3
        assert (
            client.post("/v1/classifiers/triage/decide", json={"state": "s"}, headers=key).status_code == 200
        )
    missing = client.post("/v1/classifiers/nope/decide", json={"state": "s"}, headers=key)  # 4: charged too
    assert missing.status_code == 404
    refused = client.post("/v1/classifiers/triage/decide", json={"state": "s"}, headers=key)
    assert refused.status_code == 429 and refused.json()["detail"]["error_type"] == "rate_limited"
    assert refused.headers["retry-after"]
    assert len(served.engine.batches) == 2
    # The limit is the key's, shared with the other routes.
    assert (
        client.post("/v1/systemone", json={"state": "s", "questions": QUESTIONS}, headers=key).status_code
        == 429
    )
    assert client.get("/v1/classifiers", headers=key).status_code == 429


# ------------------------------------------------------------------------------------------ availability


def test_an_unavailable_database_is_a_503_and_decisions_go_on(app_on: Callable[..., Served]) -> None:
    served = app_on()
    save(served.client)
    served.app.state.classifiers.close()  # as if the file had gone away under the server
    for method, path in (("GET", "/v1/classifiers"), ("PUT", "/v1/classifiers/triage")):
        response = served.client.request(method, path, json={"questions": QUESTIONS})
        assert response.status_code == 503, response.text
        assert response.json()["detail"]["error_type"] == "classifiers_unavailable"
        assert response.headers["retry-after"]
    assert served.client.post("/v1/systemone", json={"state": "s", "questions": QUESTIONS}).status_code == 200


def test_a_damaged_database_stops_the_server_before_it_listens(tmp_path: Path) -> None:
    damaged = tmp_path / "classifiers.sqlite3"
    damaged.write_bytes(b"not sqlite" * 100)
    jobs = tmp_path / "jobs.sqlite3"
    with pytest.raises(ClassifierStoreError, match="--classifiers-db"):
        build_app(ServerSettings(model="fake", jobs_db=str(jobs), classifiers_db=str(damaged)), FakeClef())
    JobStore(jobs).close()  # the jobs database is not left locked by the failed start


# --------------------------------------------------------------------------------------------- the docs


def test_the_routes_are_documented_and_every_example_is_accepted(app_on: Callable[..., Served]) -> None:
    engine = FakeClef()
    engine.load_head("fraud-v2", "/heads/fraud-v2")
    client = app_on(engine=engine).client
    paths = client.get("/openapi.json").json()["paths"]
    assert set(paths["/v1/classifiers/{name}"]) == {"put", "get", "delete"}
    assert "get" in paths["/v1/classifiers"] and "post" in paths["/v1/classifiers/{name}/decide"]
    put_op = paths["/v1/classifiers/{name}"]["put"]
    assert {"200", "201", "422"} <= set(put_op["responses"])
    for name, example in CLASSIFIER_EXAMPLES.items():
        response = client.put(f"/v1/classifiers/{name}", json=example["value"])
        assert response.status_code == 201, response.text
        for decide_example in DECIDE_EXAMPLES.values():
            decided = client.post(f"/v1/classifiers/{name}/decide", json=decide_example["value"])
            assert decided.status_code == 200, decided.text
            assert set(decided.json()["answers"]) == set(example["value"]["questions"])
