"""Tuned heads and independent questions through the HTTP server: a request's ``model`` picks a head (the
answer equals ``clef decide --head``), ``/v1/models`` lists each head, another head on a known state is a
cache hit, and ``x_independent`` requests are answered as their single-question parts (interactive and in
batch jobs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clef_runtime import Clef
from tests.engine.head_dirs import write_tuned_head
from tests.helpers import run_cli
from tests.server.conftest import Served
from tests.server.jobs.test_jobs_api import jsonl, results, wait_done

QUESTIONS: dict[str, Any] = {
    "billing": {"type": "noul", "instructions": "is this about billing?"},
    "team": {"type": "choice", "criteria": {"pay": "payments", "eng": "engineering"}},
    "urgency": {"type": "score", "criteria": ["low", "mid", "high"]},
}


def body(state: str, **extra: Any) -> dict[str, Any]:
    return {"state": state, "questions": QUESTIONS, **extra}


@pytest.fixture(scope="module")
def tuned_dir(tiny: Clef, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tuned_head(tiny.path, tmp_path_factory.mktemp("head") / "tuned", seed=7)


@pytest.fixture
def served(serve_fake: Callable[..., Served], tuned_dir: Path) -> Served:
    engine = Clef.load("tiny", dtype="fp32", head=f"support={tuned_dir}")
    return serve_fake(engine=engine, deterministic=True)


def test_a_served_head_answers_as_clef_decide_with_that_head(
    served: Served, tuned_dir: Path, tmp_path: Path
) -> None:
    source = tmp_path / "r.jsonl"
    source.write_text(json.dumps(body("refund please, charged twice")) + "\n")
    cli = run_cli("decide", "--model", "tiny", "--head", str(tuned_dir), str(source))
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout)
    response = served.client.post("/v1/systemone", json=body("refund please, charged twice", model="support"))
    assert response.status_code == 200
    assert response.json()["answers"] == expected["answers"]
    assert response.json()["model"] == "support"
    release = served.client.post("/v1/systemone", json=body("refund please, charged twice"))
    assert release.json()["answers"] != expected["answers"]


def test_models_lists_the_base_model_and_each_head(served: Served, tuned_dir: Path) -> None:
    listing = served.client.get("/v1/models").json()
    assert [card["name"] for card in listing["models"]] == ["tiny", "support"]
    ids = [entry["id"] for entry in listing["data"]]
    assert ids == ["tiny", "support"]
    base, head = (entry["x_head"] for entry in listing["data"])
    assert head["base_model"] == "tiny" and head["path"] == str(tuned_dir) and len(head["digest"]) == 64
    assert base["name"] == "tiny" and base["default"] and base["digest"] != head["digest"]
    heads = served.client.get("/v1/heads").json()["data"]
    assert [(h["name"], h["digest"]) for h in heads] == [
        ("tiny", base["digest"]),
        ("support", head["digest"]),
    ]


def test_another_head_on_a_known_state_is_a_cache_hit(served: Served) -> None:
    state = "a state first asked through the release head " * 3
    first = served.client.post("/v1/systemone", json=body(state))
    assert first.headers["x-clef-state-cache"] == "miss"
    second = served.client.post("/v1/systemone", json=body(state, model="support"))
    assert second.headers["x-clef-state-cache"] == "hit"
    assert int(second.headers["x-clef-cached-tokens"]) > 0


def test_x_independent_over_http_equals_the_single_question_requests(served: Served) -> None:
    state = "the deploy failed on three hosts after the billing change"
    joint = served.client.post("/v1/systemone", json=body(state, model="support")).json()
    independent = served.client.post(
        "/v1/systemone", json=body(state, model="support", x_independent=True)
    ).json()
    assert list(independent["answers"]) == list(QUESTIONS)
    tokens = 0
    for question_id, question in QUESTIONS.items():
        alone = served.client.post(
            "/v1/systemone",
            json={"state": state, "model": "support", "questions": {question_id: question}},
        ).json()
        assert independent["answers"][question_id] == alone["answers"][question_id]
        tokens += alone["usage"]["input_tokens"]
    assert independent["usage"]["input_tokens"] == tokens
    assert independent["answers"] != joint["answers"]


def test_x_independent_must_be_a_boolean_over_http(served: Served) -> None:
    response = served.client.post("/v1/systemone", json=body("s", x_independent="yes"))
    assert response.status_code == 422
    assert "x_independent" in json.dumps(response.json())


def test_x_independent_batch_job_lines_run_as_parts(
    serve_fake: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve_fake(jobs_db=str(tmp_path / "jobs.sqlite3"))
    lines = [body(f"state {i}", x_independent=True) for i in range(3)]
    created = served.client.post("/v1/jobs", content=jsonl(lines))
    assert created.status_code == 202, created.text
    wait_done(served.client, created.json()["id"])
    rows = results(served.client, created.json()["id"])
    assert len(rows) == 3
    for row, line in zip(rows, lines, strict=True):
        assert list(row["response"]["answers"]) == list(QUESTIONS)
        interactive = served.client.post("/v1/systemone", json=line).json()
        assert row["response"]["answers"] == interactive["answers"]
        assert row["response"]["usage"] == interactive["usage"]
    # Every line ran as three one-question parts (the fake engine records each part's state).
    assert sum(len(batch) for batch in served.engine.batches) == 2 * 3 * 3
