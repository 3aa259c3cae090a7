"""``x_explain`` in a job's lines: each line's option reaches the engine, and the stored result keeps what
the interactive route answers: each answer's ``x_evidence`` and the body's ``x_explain``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from clef_runtime.protocol.explain import ExplainOptions
from tests.server.conftest import Served
from tests.server.explaining_engine import FAKE_METHOD, ExplainingEngine
from tests.server.jobs.test_jobs_api import jsonl, request_line, results, wait_done


def test_a_jobs_lines_carry_x_explain_and_the_results_keep_the_evidence(
    serve_fake: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve_fake(ExplainingEngine(), jobs_db=str(tmp_path / "jobs.sqlite3"))
    rows = [request_line(0, x_explain={"top_k": 2, "granularity": "token"}), request_line(1)]
    job = served.client.post("/v1/jobs", content=jsonl(rows)).json()
    assert wait_done(served.client, job["id"])["counts"]["done"] == 2
    assert sorted(served.engine.explained, key=lambda o: o is None) == [  # type: ignore[attr-defined]
        ExplainOptions(top_k=2, granularity="token"),
        None,
    ]
    explained, plain = (result["response"] for result in results(served.client, job["id"]))
    assert explained["x_explain"]["method"] == FAKE_METHOD and explained["x_explain"]["top_k"] == 2
    assert all(1 <= len(answer["x_evidence"]) <= 2 for answer in explained["answers"].values())
    assert "x_explain" not in plain and all("x_evidence" not in a for a in plain["answers"].values())


def test_a_line_with_a_bad_x_explain_is_refused_with_its_number_and_field(
    serve_fake: Callable[..., Served], tmp_path: Path
) -> None:
    served = serve_fake(ExplainingEngine(), jobs_db=str(tmp_path / "jobs.sqlite3"))
    rows = [request_line(0), request_line(1, x_explain={"top_k": 50})]
    refused = served.client.post("/v1/jobs", content=jsonl(rows))
    assert refused.status_code == 422
    assert [item["loc"] for item in refused.json()["detail"]] == [["body", "line", 2, "x_explain", "top_k"]]
