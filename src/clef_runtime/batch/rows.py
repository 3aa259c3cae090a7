"""The records that cross the batch pipeline: an input row, an answered row, and their Arrow schemas.

Rows travel between the driver and the workers (Ray's object store) as Arrow tables with these columns, so
the records here convert to and from plain column lists.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

__all__ = [
    "INPUT_SCHEMA",
    "OUTPUT_SCHEMA",
    "InputRow",
    "OutputRow",
    "input_rows",
    "input_table",
    "output_rows",
    "output_table",
    "state_group",
]


@dataclass(frozen=True)
class InputRow:
    """One row of INPUT: its 1-based ``line`` (the line of a JSONL file, the row of a Parquet input, counted
    over its files in name order), its ``custom_id`` (None when it gave none), the request as JSON text
    without ``custom_id`` (None when the row is unusable: then ``error`` says why) and its ``group``: the
    digest of what makes its state (`state_group`), by which rows about the same state are batched together.
    """

    line: int
    custom_id: str | None
    request: str | None
    error: str | None = None
    group: str = ""


@dataclass(frozen=True)
class OutputRow:
    """One row of OUTPUT: the input row's ``custom_id`` and ``line``, and either its System One ``response``
    or its ``error`` (``{"type", "message", "detail"?}``), both as JSON text. ``cache`` is what the state
    cache did for it (``hit``, ``partial``, ``miss``; None for an error)."""

    custom_id: str | None
    line: int
    response: str | None
    error: str | None
    cache: str | None = None

    def __post_init__(self) -> None:
        if (self.response is None) == (self.error is None):
            raise ValueError("an output row holds either a response or an error")


INPUT_SCHEMA = pa.schema(
    [
        ("line", pa.int64()),
        ("custom_id", pa.string()),
        ("request", pa.large_string()),
        ("error", pa.string()),
        ("group", pa.string()),
    ]
)
OUTPUT_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("line", pa.int64()),
        ("response", pa.large_string()),
        ("error", pa.string()),
        ("cache", pa.string()),
    ]
)


def input_table(rows: Sequence[InputRow]) -> pa.Table:
    """``rows`` as an Arrow table of `INPUT_SCHEMA`."""
    return _table(rows, INPUT_SCHEMA)


def input_rows(table: pa.Table | dict[str, Any]) -> list[InputRow]:
    """The rows of an `input_table` (or of the column dict Ray Data hands a batch function)."""
    columns = _columns(table, INPUT_SCHEMA.names)
    return [InputRow(*values) for values in zip(*columns, strict=True)]


def output_table(rows: Sequence[OutputRow]) -> pa.Table:
    """``rows`` as an Arrow table of `OUTPUT_SCHEMA`."""
    return _table(rows, OUTPUT_SCHEMA)


def output_rows(table: pa.Table | dict[str, Any]) -> list[OutputRow]:
    """The rows of an `output_table` (or of a column dict)."""
    columns = _columns(table, OUTPUT_SCHEMA.names)
    return [OutputRow(*values) for values in zip(*columns, strict=True)]


def _table(rows: Sequence[InputRow] | Sequence[OutputRow], schema: pa.Schema) -> pa.Table:
    """The records' fields, named as the schema's columns, as a table of that schema."""
    return pa.table({name: [getattr(row, name) for row in rows] for name in schema.names}, schema=schema)


def _columns(table: pa.Table | dict[str, Any], names: Sequence[str]) -> list[list[Any]]:
    if isinstance(table, pa.Table):
        return [table.column(name).to_pylist() for name in names]
    return [[_plain(value) for value in table[name]] for name in names]


def _plain(value: Any) -> Any:
    """A numpy scalar as its Python value (Ray Data's numpy batches), anything else as it is."""
    return value.item() if hasattr(value, "item") else value


def state_group(body: dict[str, Any]) -> str:
    """What rows about the same state share: a digest of the request's ``state`` and ``images`` as canonical
    JSON. Two requests with equal digests render the same state tokens and the same images, so the second
    finds the first's state in the state cache when both run on the same worker. (The engine's own state key
    needs the tokenizer; this one is computed on the driver before any model loads. Requests whose states
    differ only in JSON key order get different digests: they render differently too.)"""
    what = {"state": body.get("state"), "images": body.get("images")}
    text = json.dumps(what, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
