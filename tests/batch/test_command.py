"""``clef batch`` in this process: every line once, error rows, the state cache across rows about one state,
answers equal to the server's, the formats, and the usage errors (exit 2, nothing computed)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from clef_runtime.batch.output import read_output
from clef_runtime.engine.clef import Clef
from tests.batch.requests import assert_same_answer, ticket_requests, write_jsonl, write_parquet
from tests.helpers import run_cli
from tests.live_server import Live, systemone


def _batch(*args: str) -> tuple[int, dict, str]:
    run = run_cli("batch", *args)
    summary = json.loads(run.stdout) if run.returncode == 0 else {}
    return run.returncode, summary, run.stderr


def test_every_line_is_answered_once_and_rows_about_one_state_hit_the_cache(tmp_path: Path) -> None:
    requests = ticket_requests(24, 5)
    lines: list = [*requests[:10], "{not json", *requests[10:]]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    status, summary, stderr = _batch(str(source), str(tmp_path / "out"), "--batch-rows", "8")
    assert status == 0, stderr
    rows = read_output(str(tmp_path / "out"))
    assert [row.line for row in rows] == list(range(1, 26))
    bad = rows[10]
    assert bad.response is None and json.loads(bad.error or "")["detail"][0]["type"] == "json_invalid"
    by_state: dict[str, list[str | None]] = defaultdict(list)
    for row in rows:
        if row.response is not None:
            index = int((row.custom_id or "t-0").split("-")[1])
            by_state[f"s{index % 5}"].append(row.cache)
            assert json.loads(row.response)["x_state_cache"] == row.cache
    # The first row about each state computes it; every later one finds it.
    assert {state: caches.count("miss") for state, caches in by_state.items()} == {
        f"s{i}": 1 for i in range(5)
    }
    assert all(cache in ("miss", "hit") for caches in by_state.values() for cache in caches)
    assert summary | {"seconds": 0, "rows_per_s": 0} == {
        "rows": 25,
        "skipped": 0,
        "computed": 25,
        "errors": 1,
        "answered": 24,
        "cache_hits": 19,
        "seconds": 0,
        "rows_per_s": 0,
        "batches": summary["batches"],
        "output": str(tmp_path / "out"),
    }
    assert "25 computed (1 errors)" in stderr and "19 hits of 24 answers" in stderr


def test_fp32_answers_equal_the_servers(tmp_path: Path) -> None:
    requests = ticket_requests(12, 4)
    requests[5] = {
        **requests[5],
        "questions": {"level": {"type": "score", "criteria": ["low", "mid", "high"]}},
    }
    source = write_jsonl(tmp_path / "in.jsonl", requests)
    status, _, stderr = _batch(str(source), str(tmp_path / "out"), "--dtype", "fp32", "--batch-rows", "5")
    assert status == 0, stderr
    rows = {row.custom_id: json.loads(row.response or "") for row in read_output(str(tmp_path / "out"))}
    live = Live(Clef.load("tiny", dtype="fp32"))
    try:
        for request in requests:
            online = systemone(live, {k: v for k, v in request.items() if k != "custom_id"})
            offline = rows[request["custom_id"]]
            assert offline["answers"].keys() == online["answers"].keys()
            for question, answer in online["answers"].items():
                assert_same_answer(offline["answers"][question], answer)
            assert offline["usage"]["input_tokens"] == online["usage"]["input_tokens"]
    finally:
        live.stop()


def test_parquet_in_jsonl_out_matches_jsonl_in_parquet_out(tmp_path: Path) -> None:
    requests = ticket_requests(6, 3)
    jsonl = write_jsonl(tmp_path / "in.jsonl", requests)
    parquet = write_parquet(
        tmp_path / "in.parquet",
        {
            "custom_id": [r["custom_id"] for r in requests],
            "request": [json.dumps({k: v for k, v in r.items() if k != "custom_id"}) for r in requests],
        },
    )
    assert _batch(str(jsonl), str(tmp_path / "a"), "--dtype", "fp32")[0] == 0
    assert _batch(str(parquet), str(tmp_path / "b"), "--dtype", "fp32", "--format", "jsonl")[0] == 0
    first = read_output(str(tmp_path / "a"))
    second = read_output(str(tmp_path / "b"))
    assert [(r.custom_id, r.line) for r in first] == [(r.custom_id, r.line) for r in second]
    assert [json.loads(r.response or "")["answers"] for r in first] == [
        json.loads(r.response or "")["answers"] for r in second
    ]
    (part,) = sorted((tmp_path / "b").glob("part-*.jsonl"))
    assert json.loads(part.read_text().splitlines()[0])["response"]["model"] == "tiny"


def test_a_rerun_of_a_finished_job_computes_nothing(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ticket_requests(5, 5))
    assert _batch(str(source), str(tmp_path / "out"))[0] == 0
    status, summary, stderr = _batch(str(source), str(tmp_path / "out"))
    assert status == 0, stderr
    assert (summary["skipped"], summary["computed"]) == (5, 0)
    assert len(read_output(str(tmp_path / "out"))) == 5


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("duplicate", "line 3: custom_id 't-0' repeats line 1's"),
        ("missing", "no such file"),
        ("batch_rows", "--batch-rows"),
        ("format", "--format"),
        ("other_job", "holds the results of another job"),
        ("replicas", "--replicas"),
    ],
)
def test_usage_errors_exit_2_naming_the_problem_and_compute_nothing(
    tmp_path: Path, case: str, message: str
) -> None:
    requests = ticket_requests(3, 3)
    if case == "duplicate":
        requests[2]["custom_id"] = "t-0"
    source = write_jsonl(tmp_path / "in.jsonl", requests)
    out = tmp_path / "out"
    args = [str(source), str(out)]
    if case == "missing":
        args[0] = str(tmp_path / "nowhere.jsonl")
    elif case == "batch_rows":
        args += ["--batch-rows", "0"]
    elif case == "format":
        args += ["--format", "csv"]
    elif case == "replicas":
        args += ["--ray", "--replicas", "0"]
    elif case == "other_job":
        assert _batch(*args)[0] == 0
        args += ["--confidence", "typesafe"]
    before = sorted(p.name for p in out.glob("part-*")) if out.exists() else []
    run = run_cli("batch", *args)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    after = sorted(p.name for p in out.glob("part-*")) if out.exists() else []
    assert after == before


def test_a_progress_bar_counts_the_rows_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clef_runtime.batch.pipeline import BatchJob, run_batch

    source = write_jsonl(tmp_path / "in.jsonl", ticket_requests(6, 3))
    run_batch(BatchJob(str(source), str(tmp_path / "out"), progress=True))
    assert "6/6" in capsys.readouterr().err
    # The negative control: without it (what a pipe gets) nothing is drawn.
    run_batch(BatchJob(str(source), str(tmp_path / "again"), progress=False))
    assert "6/6" not in capsys.readouterr().err


def test_the_python_example_of_docs_batch_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "batch.md").read_text(encoding="utf-8")
    (snippet,) = re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    write_jsonl(tmp_path / "tickets.jsonl", ticket_requests(4, 2))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "docs/batch.md", "exec"), namespace)
    assert [row.custom_id for row in namespace["rows"]] == ["t-0", "t-1", "t-2", "t-3"]
    assert namespace["summary"].computed == 4


def test_a_row_that_breaks_preparation_is_an_error_row_not_a_failed_batch(tmp_path: Path) -> None:
    from unittest import mock

    from clef_runtime.batch.rows import InputRow
    from clef_runtime.batch.worker import answer_rows

    clef = Clef.load("tiny", dtype="fp32")
    requests = ticket_requests(3, 3)
    rows = [
        InputRow(i + 1, r["custom_id"], json.dumps({k: v for k, v in r.items() if k != "custom_id"}))
        for i, r in enumerate(requests)
    ]
    real_prepare = clef.prepare

    def prepare(request: dict, **kwargs: object) -> object:
        if "order 1" in request["state"]:
            raise RuntimeError("a bug in preparation")
        return real_prepare(request, **kwargs)

    with mock.patch.object(clef, "prepare", side_effect=prepare):
        out = answer_rows(clef, rows)
    assert [row.line for row in out] == [1, 2, 3]
    assert out[1].response is None and json.loads(out[1].error or "")["type"] == "internal_error"
    assert "a bug in preparation" in json.loads(out[1].error or "")["message"]
    assert out[0].response is not None and out[2].response is not None


@pytest.mark.parametrize(
    ("flags", "gpus"),
    [([], 0.0), (["--device", "cuda"], 1.0), (["--device", "cuda:1", "--ray-num-gpus", "0.5"], 0.5)],
)
def test_a_cuda_device_reserves_a_gpu_per_actor_unless_told(flags: list[str], gpus: float) -> None:
    from clef_runtime.batch.command import _job
    from clef_runtime.cli import build_parser

    args = build_parser().parse_args(["batch", "in.jsonl", "out", "--ray", "--replicas", "3", *flags])
    job = _job(args)
    assert job.ray is not None
    assert (job.ray.address, job.ray.replicas, job.ray.num_gpus) == (None, 3, gpus)


def test_hits_reuse_the_state_and_without_a_state_cache_there_are_none(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ticket_requests(12, 3))
    status, summary, stderr = _batch(str(source), str(tmp_path / "out"))
    assert status == 0, stderr
    rows = read_output(str(tmp_path / "out"))
    for row in rows:
        cached = json.loads(row.response or "")["usage"]["input_tokens_details"]["cached_tokens"]
        # A hit took its state's tokens from the cache instead of running them; a miss ran them all.
        assert (cached > 0) == (row.cache == "hit"), row
    assert summary["cache_hits"] == 9
    # The negative control: with no state cache and batches of 3 in input order (rows about one state are 3
    # apart: never in one batch, where the engine would still share a state between rows), every row
    # computes its own state.
    status, summary, stderr = _batch(
        str(source), str(tmp_path / "uncached"), "--cache-mb", "0", "--grouping", "none", "--batch-rows", "3"
    )
    assert status == 0, stderr
    assert summary["cache_hits"] == 0


def test_a_commit_is_also_made_every_commit_seconds(tmp_path: Path) -> None:
    from clef_runtime.batch.pipeline import BatchJob, run_batch

    source = write_jsonl(tmp_path / "in.jsonl", ticket_requests(12, 12))
    run_batch(BatchJob(str(source), str(tmp_path / "rows"), batch_rows=4, commit_rows=10**6))
    assert len(list((tmp_path / "rows").glob("part-*"))) == 1  # one commit, at the end
    run_batch(
        BatchJob(str(source), str(tmp_path / "timed"), batch_rows=4, commit_rows=10**6, commit_seconds=1e-6)
    )
    assert len(list((tmp_path / "timed").glob("part-*"))) == 3  # one per answered batch
