"""``/v1/heads`` and names you can trust, against the fake engine: the served heads listed with their
digests, the admin key that guards loading and unloading (404 without one configured, 401 / 403 / 201 with
one), every answer naming its head (``X-Clef-Head``, ``x_head``) on every wire format, a head unloaded at run
time refused by name (never answered by the default head), ``--strict-model-names``, and saved classifiers
pinned to their head's digest."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clef_runtime import Clef
from tests.engine.head_dirs import write_tuned_head
from tests.server.classifiers.test_classifiers_api import QUESTIONS as CLASSIFIER_QUESTIONS
from tests.server.conftest import Served
from tests.server.openai.test_compat_api import CHAT, CHAT_PATH, SYSTEMONE, WORKERS

ADMIN = {"authorization": "Bearer admin-secret"}
USER = {"authorization": "Bearer user-secret"}


def admin_app(serve_fake: Callable[..., Served], **overrides: Any) -> Served:
    return serve_fake(admin_keys=("ops:admin-secret",), api_keys=("alice:user-secret",), **overrides)


def load(served: Served, name: str, path: str, headers: dict[str, str] = ADMIN) -> Any:
    return served.client.post("/v1/heads", json={"name": name, "path": path}, headers=headers)


def test_get_heads_lists_the_default_head_with_its_digest(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(api_keys=("alice:user-secret",))
    assert served.client.get("/v1/heads").status_code == 401
    (head,) = served.client.get("/v1/heads", headers=USER).json()["data"]
    (info,) = served.engine.head_infos()
    assert head == info.as_api() and head["default"] and head["name"] == served.engine.name


def test_without_an_admin_key_the_head_changes_are_not_served(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake()
    assert load(served, "billing", "/heads/billing").status_code == 404
    assert served.client.delete("/v1/heads/billing").status_code == 404
    assert "--admin-key" in served.client.delete("/v1/heads/billing").json()["detail"]["message"]
    assert [info.name for info in served.engine.head_infos()] == [served.engine.name]


def test_the_admin_routes_take_only_the_admin_key(serve_fake: Callable[..., Served]) -> None:
    served = admin_app(serve_fake)
    assert load(served, "billing", "/heads/billing", headers={}).status_code == 401
    assert (
        load(served, "billing", "/heads/billing", headers={"authorization": "Bearer nope"}).status_code == 401
    )
    forbidden = load(served, "billing", "/heads/billing", headers=USER)
    assert forbidden.status_code == 403 and forbidden.json()["detail"]["error_type"] == "permission_error"
    assert served.client.delete("/v1/heads/billing", headers=USER).status_code == 403
    created = load(served, "billing", "/heads/billing")
    assert created.status_code == 201, created.text
    assert created.json()["name"] == "billing" and len(created.json()["digest"]) == 64
    # The admin key is for the admin routes only: it does not decide.
    assert served.client.post("/v1/systemone", json=SYSTEMONE, headers=ADMIN).status_code == 401


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"name": "billing"}, ["body", "path"]),
        ({"path": "/heads/x"}, ["body", "name"]),
        ({"name": "", "path": "/heads/x"}, ["body", "name"]),
        ({"name": "billing", "path": "/heads/x", "extra": 1}, ["body", "extra"]),
        ({"name": "billing", "path": "/heads/missing"}, ["body", "path"]),
    ],
)
def test_a_bad_load_is_a_422_naming_the_field(
    serve_fake: Callable[..., Served], body: dict[str, Any], loc: list[str]
) -> None:
    served = admin_app(serve_fake)
    refused = served.client.post("/v1/heads", json=body, headers=ADMIN)
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"] == loc
    assert [info.name for info in served.engine.head_infos()] == [served.engine.name]


def test_a_name_means_one_set_of_weights(serve_fake: Callable[..., Served]) -> None:
    served = admin_app(serve_fake)
    assert load(served, "billing", "/heads/billing").status_code == 201
    taken = load(served, "billing", "/heads/billing-v2")
    assert taken.status_code == 409 and "already served" in taken.json()["detail"]["message"]
    default = served.client.delete(f"/v1/heads/{served.engine.name}", headers=ADMIN)
    assert default.status_code == 409
    assert served.client.delete("/v1/heads/never", headers=ADMIN).status_code == 404


def test_every_answer_names_its_head_on_every_wire_format(serve_fake: Callable[..., Served]) -> None:
    served = admin_app(serve_fake)
    info = load(served, "billing", "/heads/billing").json()
    label = f"billing@{info['digest'][:12]}"
    default = served.engine.head_infos()[0]
    client = served.client
    by_name = client.post("/v1/systemone", json={**SYSTEMONE, "model": "billing"}, headers=USER)
    assert by_name.headers["x-clef-head"] == label
    assert by_name.json()["x_head"] == {"name": "billing", "digest": info["digest"]}
    chat = client.post(CHAT_PATH, json={**CHAT, "model": "billing"}, headers=USER)
    assert chat.status_code == 200 and chat.headers["x-clef-head"] == label
    assert chat.json()["x_head"]["name"] == "billing"
    # Unknown names keep today's behaviour (SDKs send jev-latest): the default head answers, and says so.
    for response in (
        client.post("/v1/systemone", json={**SYSTEMONE, "model": "jev-latest"}, headers=USER),
        client.post(CHAT_PATH, json=CHAT, headers=USER),
        client.post(WORKERS, json=SYSTEMONE, headers=USER),
    ):
        assert response.status_code == 200, response.text
        assert response.headers["x-clef-head"] == f"{default.name}@{default.digest[:12]}"


def test_an_unloaded_head_is_refused_by_name_never_answered_by_another(
    serve_fake: Callable[..., Served],
) -> None:
    served = admin_app(serve_fake)
    load(served, "billing", "/heads/billing")
    unloaded = served.client.delete("/v1/heads/billing", headers=ADMIN)
    assert unloaded.status_code == 200 and unloaded.json()["unloaded"] is True
    refused = served.client.post("/v1/systemone", json={**SYSTEMONE, "model": "billing"}, headers=USER)
    assert refused.status_code == 404, refused.text
    detail = refused.json()["detail"]
    assert detail["error_type"] == "head_not_loaded" and detail["served"] == [served.engine.name]
    assert served.engine.batches == []  # nothing computed
    # Loaded again, it answers again.
    assert load(served, "billing", "/heads/billing").status_code == 201
    again = served.client.post("/v1/systemone", json={**SYSTEMONE, "model": "billing"}, headers=USER)
    assert again.status_code == 200 and again.headers["x-clef-head"].startswith("billing@")


def test_strict_model_names_refuse_a_name_no_head_has(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(strict_model_names=True)
    name = served.engine.name
    refused = served.client.post("/v1/systemone", json={**SYSTEMONE, "model": "jev-latest"})
    assert refused.status_code == 404 and refused.json()["detail"]["served"] == [name]
    assert "--strict-model-names" in refused.json()["detail"]["message"]
    assert served.client.post("/v1/systemone", json={**SYSTEMONE, "model": name}).status_code == 200
    assert served.client.post("/v1/systemone", json=SYSTEMONE).status_code == 200  # no model: the default
    lenient = serve_fake()
    assert lenient.client.post("/v1/systemone", json={**SYSTEMONE, "model": "jev-latest"}).status_code == 200


def test_a_request_pins_a_head_with_x_head_digest(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake()
    digest = served.engine.head_infos()[0].digest
    assert (
        served.client.post("/v1/systemone", json={**SYSTEMONE, "x_head_digest": digest[:12]}).status_code
        == 200
    )
    changed = served.client.post("/v1/systemone", json={**SYSTEMONE, "x_head_digest": "0" * 12})
    assert changed.status_code == 409 and changed.json()["detail"]["digest_served"] == digest
    malformed = served.client.post("/v1/systemone", json={**SYSTEMONE, "x_head_digest": "xyz"})
    assert malformed.status_code == 422 and malformed.json()["detail"][0]["loc"] == ["body", "x_head_digest"]


# ------------------------------------------------------------------------------------ saved classifiers


def save(served: Served, head: str | None = None) -> Any:
    body = {"questions": CLASSIFIER_QUESTIONS, **({"head": head} if head else {})}
    return served.client.put("/v1/classifiers/triage", json=body, headers=USER)


def decide(served: Served) -> Any:
    return served.client.post("/v1/classifiers/triage/decide", json={"state": "charged twice"}, headers=USER)


def test_a_classifier_pins_the_digest_of_its_head(serve_fake: Callable[..., Served]) -> None:
    served = admin_app(serve_fake)
    first = load(served, "billing", "/heads/billing").json()
    saved = save(served, "billing").json()
    assert saved["head_digest"] == first["digest"] and saved["head_status"]["status"] == "ok"
    assert decide(served).headers["x-clef-head"] == f"billing@{first['digest'][:12]}"

    # The head unloaded: refused, naming the head and what to do; never the default head's answer.
    served.client.delete("/v1/heads/billing", headers=ADMIN)
    missing = decide(served)
    assert missing.status_code == 503, missing.text
    detail = missing.json()["detail"]
    assert detail["error_type"] == "head_not_loaded" and detail["head"] == "billing"
    assert detail["digest_recorded"] == first["digest"] and "POST /v1/heads" in detail["message"]
    listed = served.client.get("/v1/classifiers", headers=USER).json()["data"][0]
    assert listed["head_status"] == {"status": "head_not_loaded", "digest_served": None}

    # Other weights under the same name: refused with both digests.
    second = load(served, "billing", "/heads/billing-v2").json()
    changed = decide(served)
    assert changed.status_code == 409
    detail = changed.json()["detail"]
    assert (detail["error_type"], detail["digest_recorded"], detail["digest_served"]) == (
        "head_changed",
        first["digest"],
        second["digest"],
    )
    assert "PUT /v1/classifiers/triage" in detail["message"]

    # PUT again accepts the head served now.
    assert save(served, "billing").json()["head_digest"] == second["digest"]
    assert decide(served).status_code == 200
    assert served.engine.batches and len(served.engine.batches) == 2  # the refused calls computed nothing


def test_a_classifier_without_a_head_pins_the_default_head(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(api_keys=("alice:user-secret",))
    saved = save(served).json()
    assert saved["head_digest"] == served.engine.head_infos()[0].digest
    assert decide(served).status_code == 200
    # A later start whose default head is another (a bare --head DIR) refuses it.
    other = serve_fake(
        api_keys=("alice:user-secret",), classifiers_db=str(served.settings.classifiers_db_path)
    )
    name = other.engine.name
    other.engine.heads[name] = dataclasses.replace(other.engine.heads[name], digest="f" * 64)
    refused = decide(other)
    assert refused.status_code == 409 and refused.json()["detail"]["digest_served"] == "f" * 64


# ----------------------------------------------------------------------------- the new user's finding


@pytest.mark.slow
def test_a_restart_without_the_head_refuses_the_classifier_instead_of_the_release_heads_answer(
    serve_fake: Callable[..., Served], tiny: Clef, tmp_path: Path
) -> None:
    """The finding, on the real model: saved with ``--head billing=DIR``, the classifier was answered by the
    release head after a restart without it (200, ``"model": "billing"``, other numbers). Now: 503 without
    the head, 409 with other weights under its name, and its own answer again with its own head."""
    first_dir = write_tuned_head(tiny.path, tmp_path / "billing", seed=11)
    other_dir = write_tuned_head(tiny.path, tmp_path / "billing-v2", seed=12)
    shared = {"classifiers_db": str(tmp_path / "classifiers.sqlite3"), "api_keys": ("alice:user-secret",)}
    with_head = serve_fake(engine=Clef.load("tiny", dtype="fp32", head=f"billing={first_dir}"), **shared)
    assert save(with_head, "billing").status_code == 201
    answered = decide(with_head)
    assert answered.status_code == 200 and answered.json()["model"] == "billing"

    restarted = serve_fake(engine=Clef.load("tiny", dtype="fp32"), admin_keys=("admin-secret",), **shared)
    missing = decide(restarted)
    assert missing.status_code == 503 and missing.json()["detail"]["error_type"] == "head_not_loaded"
    assert load(restarted, "billing", str(other_dir)).status_code == 201
    assert decide(restarted).json()["detail"]["error_type"] == "head_changed"
    restarted.client.delete("/v1/heads/billing", headers=ADMIN)
    assert load(restarted, "billing", str(first_dir)).status_code == 201
    again = decide(restarted)
    assert again.status_code == 200 and again.json()["answers"] == answered.json()["answers"]
