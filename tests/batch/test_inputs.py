"""Reading INPUT: JSONL and Parquet (a request column or the body's fields as columns), files and folders,
row errors that become error rows, and the inputs refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_runtime.batch.inputs import DuplicateCustomIdError, InputError, read_input
from clef_runtime.batch.rows import input_rows, state_group
from tests.batch.requests import QUESTIONS, ticket_requests, write_jsonl, write_parquet


def test_jsonl_rows_keep_their_line_numbers_and_lose_their_custom_id(tmp_path: Path) -> None:
    requests = ticket_requests(3, 2)
    path = write_jsonl(tmp_path / "in.jsonl", [requests[0], "", requests[1], requests[2]])
    rows = input_rows(read_input(str(path)).table)
    assert [(row.line, row.custom_id) for row in rows] == [(1, "t-0"), (3, "t-1"), (4, "t-2")]
    assert json.loads(rows[0].request or "") == {k: v for k, v in requests[0].items() if k != "custom_id"}
    # Rows 1 and 3 of the input (t-0, t-2) are about the same state; t-1 is not.
    assert rows[0].group == rows[2].group != rows[1].group


def test_a_bad_row_becomes_an_error_row_naming_the_field(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [
            "{not json",
            "[1, 2]",
            {"custom_id": 7, "state": "s", "questions": QUESTIONS},
            ticket_requests(1, 1)[0],
        ],
    )
    rows = input_rows(read_input(str(path)).table)
    errors = [json.loads(row.error) if row.error else None for row in rows]
    assert [row.request is None for row in rows] == [True, True, True, False]
    assert errors[0]["detail"][0]["type"] == "json_invalid"
    assert "JSON object" in errors[1]["message"]
    assert errors[2]["detail"][0]["loc"] == ["custom_id"]
    assert errors[3] is None


def test_a_repeated_custom_id_refuses_the_input_naming_both_lines(tmp_path: Path) -> None:
    requests = ticket_requests(4, 2)
    requests[3]["custom_id"] = "t-1"
    path = write_jsonl(tmp_path / "in.jsonl", requests)
    with pytest.raises(DuplicateCustomIdError) as caught:
        read_input(str(path))
    assert (caught.value.custom_id, caught.value.first_line, caught.value.line) == ("t-1", 2, 4)
    assert "line 4" in str(caught.value) and "'t-1'" in str(caught.value)
    # The negative control: without the repeat the same input reads.
    requests[3]["custom_id"] = "t-3"
    assert read_input(str(write_jsonl(tmp_path / "ok.jsonl", requests))).rows == 4


def test_parquet_with_a_request_column_reads_like_jsonl(tmp_path: Path) -> None:
    requests = ticket_requests(3, 3)
    jsonl = input_rows(read_input(str(write_jsonl(tmp_path / "in.jsonl", requests))).table)
    bodies = [json.dumps({k: v for k, v in r.items() if k != "custom_id"}) for r in requests]
    path = write_parquet(
        tmp_path / "in.parquet", {"custom_id": [r["custom_id"] for r in requests], "request": bodies}
    )
    parquet = input_rows(read_input(str(path)).table)
    assert parquet == jsonl


def test_parquet_with_the_body_fields_as_columns(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "in.parquet",
        {
            "custom_id": [101, 102, None],
            "state": ["first", "second", "third"],
            "questions": [json.dumps(QUESTIONS), json.dumps({"q": {"type": "noul"}}), "{broken"],
            "model": [None, "tiny", None],
        },
    )
    rows = input_rows(read_input(str(path)).table)
    assert [row.custom_id for row in rows] == ["101", "102", None]  # integers as their decimal text
    assert json.loads(rows[0].request or "") == {"state": "first", "questions": QUESTIONS}
    assert json.loads(rows[1].request or "")["model"] == "tiny"
    assert rows[2].request is None
    assert json.loads(rows[2].error or "")["detail"][0]["loc"] == ["questions"]


def test_parquet_without_usable_columns_is_refused(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {"text": ["a"]})
    with pytest.raises(InputError, match="'request' column"):
        read_input(str(path))


def test_a_folder_is_read_in_name_order_skipping_hidden_files(tmp_path: Path) -> None:
    requests = ticket_requests(4, 4)
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", requests[2:])
    write_jsonl(folder / "a.jsonl", requests[:2])
    (folder / "_SUCCESS").write_text("")
    (folder / ".a.jsonl.crc").write_text("junk")
    source = read_input(f"file://{folder}")
    assert [row.custom_id for row in input_rows(source.table)] == ["t-0", "t-1", "t-2", "t-3"]
    assert [row.line for row in input_rows(source.table)] == [1, 2, 3, 4]


@pytest.mark.parametrize("make", ["missing", "empty", "not_utf8"])
def test_unreadable_inputs_are_refused_with_the_reason(tmp_path: Path, make: str) -> None:
    path = tmp_path / "in.jsonl"
    if make == "empty":
        path.write_text("\n\n")
    elif make == "not_utf8":
        path.write_bytes(b'{"state": "\xff"}\n')
    with pytest.raises(
        InputError, match={"missing": "no such file", "empty": "holds no request", "not_utf8": "UTF-8"}[make]
    ):
        read_input(str(path))


def test_the_digest_changes_with_the_content(tmp_path: Path) -> None:
    requests = ticket_requests(3, 3)
    first = read_input(str(write_jsonl(tmp_path / "a.jsonl", requests))).digest
    assert read_input(str(write_jsonl(tmp_path / "b.jsonl", requests))).digest == first
    requests[1]["state"] = "changed"
    assert read_input(str(write_jsonl(tmp_path / "c.jsonl", requests))).digest != first


def test_state_group_follows_state_and_images_only() -> None:
    base = {"state": {"a": 1}, "questions": QUESTIONS}
    assert state_group(base) == state_group({**base, "questions": {"q": {"type": "noul"}}, "model": "x"})
    assert state_group(base) != state_group({**base, "state": {"a": 2}})
    assert state_group(base) != state_group({**base, "images": ["data:image/png;base64,AAAA"]})
