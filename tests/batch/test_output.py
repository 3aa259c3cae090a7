"""OUTPUT: part files committed whole, each line exactly once, resumable, and refused for another job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_runtime.batch.output import MANIFEST, BatchOutput, OutputConflictError, read_output
from clef_runtime.batch.rows import OutputRow

JOB = {"input": "digest-1", "model": "tiny"}


def _rows(lines: range) -> list[OutputRow]:
    return [
        OutputRow(
            f"t-{line}", line, _compact({"answers": {"q": line}, "x_state_cache": "miss"}), None, "miss"
        )
        for line in lines
    ]


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_line_committed_twice_is_written_once(tmp_path: Path, fmt: str) -> None:
    output = BatchOutput.open(str(tmp_path / "out"), fmt=fmt, job=JOB)  # type: ignore[arg-type]
    assert [row.line for row in output.commit(_rows(range(1, 6)))] == [1, 2, 3, 4, 5]
    # A retried batch hands lines 4-5 over again with new ones: only the new ones are written.
    assert [row.line for row in output.commit(_rows(range(4, 9)))] == [6, 7, 8]
    assert output.commit(_rows(range(1, 3))) == []
    rows = read_output(str(tmp_path / "out"))
    assert [row.line for row in rows] == list(range(1, 9))
    assert rows[0] == _rows(range(1, 2))[0]
    assert len(output.part_files()) == 2


def test_jsonl_parts_hold_the_jobs_result_lines(tmp_path: Path) -> None:
    output = BatchOutput.open(str(tmp_path / "out"), fmt="jsonl", job=JOB)
    output.commit(
        [*_rows(range(1, 2)), OutputRow(None, 2, None, json.dumps({"type": "invalid_request_error"}))]
    )
    (part,) = output.part_files()
    lines = [json.loads(text) for text in Path(part).read_text().splitlines()]
    assert lines == [
        {"custom_id": "t-1", "line": 1, "response": {"answers": {"q": 1}, "x_state_cache": "miss"}},
        {"custom_id": None, "line": 2, "error": {"type": "invalid_request_error"}},
    ]


def test_a_rerun_knows_the_committed_lines_and_drops_half_written_files(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    first = BatchOutput.open(str(folder), fmt="parquet", job=JOB)
    first.commit(_rows(range(1, 4)))
    (folder / ".tmp-killed-mid-write.parquet").write_bytes(b"PAR1 half")
    second = BatchOutput.open(str(folder), fmt="parquet", job=JOB)
    assert second.done == {1, 2, 3}
    assert second.run == 2
    assert not list(folder.glob(".tmp-*"))
    second.commit(_rows(range(3, 6)))
    assert [row.line for row in read_output(str(folder))] == [1, 2, 3, 4, 5]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert [run["resumed_rows"] for run in manifest["runs"]] == [0, 3]


@pytest.mark.parametrize(
    ("fmt", "job", "message"),
    [
        ("jsonl", JOB, "--format parquet"),
        ("parquet", {**JOB, "input": "digest-2"}, "its input was 'digest-1'"),
        ("parquet", {**JOB, "model": "other"}, "its model was 'tiny'"),
    ],
)
def test_another_job_cannot_resume_into_the_folder(tmp_path: Path, fmt: str, job: dict, message: str) -> None:
    BatchOutput.open(str(tmp_path / "out"), fmt="parquet", job=JOB).commit(_rows(range(1, 2)))
    with pytest.raises(OutputConflictError, match=message):
        BatchOutput.open(str(tmp_path / "out"), fmt=fmt, job=job)  # type: ignore[arg-type]


def test_a_folder_of_other_files_is_not_taken_over(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.csv").write_text("a,b\n")
    with pytest.raises(OutputConflictError, match="not a clef batch output"):
        BatchOutput.open(str(tmp_path / "out"), fmt="parquet", job=JOB)
