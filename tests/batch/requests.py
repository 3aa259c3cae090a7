"""Batch inputs for the tests: ticket requests where some rows share a state, written as JSONL or Parquet."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

QUESTIONS = {
    "refund": {"type": "noul"},
    "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}},
}


def ticket_requests(rows: int, states: int, *, filler_words: int = 0) -> list[dict[str, Any]]:
    """``rows`` requests with ``custom_id`` ``t-0``, ``t-1``, ...; row i is about state ``i % states``, so
    rows i and i + states share a state (and are far apart in input order)."""
    filler = " ".join(f"word{j}" for j in range(filler_words))
    return [
        {
            "custom_id": f"t-{i}",
            "state": f"Ticket {i % states}: the customer asks for a refund of order {i % states}. {filler}",
            "questions": QUESTIONS,
        }
        for i in range(rows)
    ]


def write_jsonl(path: Path, rows: Sequence[dict[str, Any] | str]) -> Path:
    """One line per row (a string is written as it is: malformed lines for the tests)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def write_parquet(path: Path, columns: dict[str, list[Any]]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def outputs_by_line(rows: Sequence[Any]) -> dict[int, Any]:
    """Output rows by line; fails on a line written twice."""
    by_line: dict[int, Any] = {}
    for row in rows:
        assert row.line not in by_line, f"line {row.line} written twice"
        by_line[row.line] = row
    return by_line


def assert_same_answer(offline: dict, online: dict) -> None:
    """Equal answers: the same choice, probabilities within one unit of their 4th decimal (both sides round
    fp32 values that may differ in the 7th digit with the rows batched beside them)."""
    assert offline["type"] == online["type"]
    if online["type"] == "noul":
        assert offline["noul"] == pytest.approx(online["noul"], abs=1e-4)
        return
    assert offline[online["type"]] == online[online["type"]]
    assert offline["probabilities"].keys() == online["probabilities"].keys()
    for option, value in online["probabilities"].items():
        assert offline["probabilities"][option] == pytest.approx(value, abs=1e-4)
