"""Reading INPUT: a JSONL file (the jobs format: one System One request per line, optional ``custom_id``) or
a Parquet file, or a folder of either, on any filesystem pyarrow reads (a local path, ``file://``,
``s3://``, ``gs://``, ``hdfs://``).

A Parquet input holds either a ``request`` column (each value a request body as JSON text, or a struct)
or the body's fields as columns (``state``, ``questions``, ``model``, ``images``, ``x_explain``, ...; a
string in a column other than ``state`` and ``model`` is read as JSON text, so ``questions`` can vary in
shape from row to row), and optionally a ``custom_id`` column (strings, or integers written as decimal
text). Null values leave the field out.

Every row is checked here, on the driver, before any model loads: JSON text, an object, a ``custom_id`` of
1-256 characters. A row that fails becomes an error row of the output (never a crash); the System One
validation itself happens on the workers, as the server does it. A repeated ``custom_id`` refuses the whole
input (`DuplicateCustomIdError`): results are joined back by it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from clef_runtime.batch.rows import InputRow, input_table, state_group
from clef_runtime.jobs.runner import error_object
from clef_runtime.protocol.custom_ids import (
    custom_id_error,
    duplicate_message,
    first_duplicate,
    is_valid_custom_id,
)
from clef_runtime.protocol.errors import RequestValidationError

__all__ = [
    "BatchInput",
    "DuplicateCustomIdError",
    "InputError",
    "Location",
    "locate",
    "read_input",
]

_CHUNK_ROWS = 10_000
_PARQUET_SUFFIXES = (".parquet", ".pq")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_TEXT_FIELDS = ("state", "model", "x_head_digest")
"""Body fields whose string values are strings; in any other field column a string is JSON text."""


class InputError(Exception):
    """INPUT cannot be read as a batch input; the message names the file and what is wrong."""


class DuplicateCustomIdError(InputError):
    """Two rows of INPUT share a ``custom_id``."""

    def __init__(self, custom_id: str, first_line: int, line: int) -> None:
        super().__init__(
            f"line {line}: {duplicate_message(custom_id, first_line)} (custom_ids must be unique)"
        )
        self.custom_id = custom_id
        self.first_line = first_line
        self.line = line


@dataclass(frozen=True)
class Location:
    """A file or folder on a pyarrow filesystem, and how the user wrote it."""

    filesystem: pafs.FileSystem
    path: str
    uri: str


def locate(uri: str) -> Location:
    """The filesystem and path of ``uri``: a URI pyarrow knows (``s3://``, ``gs://``, ``file://``, ...) or
    a local path. Raises `InputError` for a URI pyarrow cannot open (an unknown scheme, missing
    credentials)."""
    if "://" not in uri:
        return Location(pafs.LocalFileSystem(), os.path.abspath(uri), uri)
    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise InputError(f"cannot open {uri}: {exc}") from None
    return Location(filesystem, path, uri)


@dataclass(frozen=True)
class BatchInput:
    """Every row of INPUT as an `clef_runtime.batch.rows.INPUT_SCHEMA` table, in line order, and a digest of
    its content (OUTPUT records it: resuming against another input is refused)."""

    table: pa.Table
    digest: str
    files: tuple[str, ...]

    @property
    def rows(self) -> int:
        return self.table.num_rows


def read_input(uri: str) -> BatchInput:
    """Read and check every row of ``uri``. Raises `InputError` (unreadable, no rows, a Parquet file without
    usable columns) or `DuplicateCustomIdError`."""
    location = locate(uri)
    files, kind = _input_files(location)
    digest = hashlib.sha256()
    tables: list[pa.Table] = []
    line = 0
    for path in files:
        chunks = _jsonl_rows(location, path, line) if kind == "jsonl" else _parquet_rows(location, path, line)
        for chunk in chunks:
            for row in chunk:
                digest.update(f"{row.line}\x00{row.custom_id}\x00{row.request}\x00{row.error}\x01".encode())
            line = chunk[-1].line if chunk else line
            tables.append(input_table(chunk))
    table = pa.concat_tables(tables) if tables else input_table([])
    if table.num_rows == 0:
        raise InputError(f"{uri} holds no request (one JSON request per line, or Parquet rows)")
    duplicate = first_duplicate(
        zip(table.column("line").to_pylist(), table.column("custom_id").to_pylist(), strict=True)
    )
    if duplicate is not None:
        raise DuplicateCustomIdError(*duplicate)
    return BatchInput(table, digest.hexdigest(), tuple(files))


def _input_files(location: Location) -> tuple[list[str], str]:
    """The files to read, in name order, and their kind (``jsonl`` or ``parquet``)."""
    try:
        info = location.filesystem.get_file_info(location.path)
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"cannot read {location.uri}: no such file or folder")
        if info.type == pafs.FileType.File:
            return [location.path], _kind(location.path)
        selector = pafs.FileSelector(location.path, recursive=True)
        names = sorted(
            entry.path
            for entry in location.filesystem.get_file_info(selector)
            if entry.type == pafs.FileType.File and not _hidden(entry.path, location.path)
        )
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"cannot read {location.uri}: {exc}") from None
    parquet = [name for name in names if name.endswith(_PARQUET_SUFFIXES)]
    if parquet:
        return parquet, "parquet"
    jsonl = [name for name in names if name.endswith(_JSONL_SUFFIXES)]
    if jsonl:
        return jsonl, "jsonl"
    raise InputError(f"{location.uri} is a folder without .parquet or .jsonl files")


def _hidden(path: str, root: str) -> bool:
    """Files Spark, Hadoop and Ray leave beside their data (``_SUCCESS``, ``.crc``, temporary files)."""
    relative = path[len(root) :].lstrip("/")
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def _kind(path: str) -> str:
    return "parquet" if path.endswith(_PARQUET_SUFFIXES) else "jsonl"


# ------------------------------------------------------------------------------------------------ JSONL


def _jsonl_rows(location: Location, path: str, line: int) -> Iterator[list[InputRow]]:
    """The rows of one JSONL file, numbered on from ``line`` (blank lines are skipped but counted)."""
    try:
        with location.filesystem.open_input_stream(path) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8")
            chunk: list[InputRow] = []
            for number, line_text in enumerate(text, start=line + 1):
                if number == line + 1 and line_text.startswith("\ufeff"):
                    line_text = line_text[1:]
                if line_text.strip():
                    chunk.append(_row_of(number, _decoded(line_text)))
                if len(chunk) >= _CHUNK_ROWS:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk
    except UnicodeDecodeError as exc:
        raise InputError(f"cannot read {path}: it is not UTF-8 text ({exc.reason})") from None
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from None


def _decoded(text: str) -> Any:
    """The JSON value of a line, or the RequestValidationError that says why it is not JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        return RequestValidationError.single(
            (), f"malformed JSON: {exc.msg} at column {exc.colno}", "json_invalid"
        )
    except (ValueError, RecursionError) as exc:
        return RequestValidationError.single((), f"malformed JSON: {exc}", "json_invalid")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# ------------------------------------------------------------------------------------------------ Parquet


def _parquet_rows(location: Location, path: str, line: int) -> Iterator[list[InputRow]]:
    """The rows of one Parquet file, numbered on from ``line``."""
    try:
        with location.filesystem.open_input_file(path) as handle:
            parquet = pq.ParquetFile(handle)
            names = parquet.schema_arrow.names
            if "request" not in names and "questions" not in names:
                raise InputError(
                    f"{path} has neither a 'request' column (each request's JSON body) nor the body's "
                    f"fields as columns ('state', 'questions', ...): its columns are {', '.join(names)}"
                )
            for batch in parquet.iter_batches(batch_size=_CHUNK_ROWS):
                records = batch.to_pylist()
                rows = [
                    _row_of(line + offset + 1, _parquet_body(record)) for offset, record in enumerate(records)
                ]
                line += len(records)
                yield rows
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from None


def _parquet_body(record: dict[str, Any]) -> Any:
    """The request of one Parquet row as a JSON value (``custom_id`` included), or the
    RequestValidationError that says why it is none."""
    custom_id = record.get("custom_id")
    if isinstance(custom_id, int) and not isinstance(custom_id, bool):
        custom_id = str(custom_id)
    if "request" in record:
        value = record["request"]
        body = _decoded(value) if isinstance(value, str) else value
        if isinstance(body, dict) and custom_id is not None:
            body = {**body, "custom_id": custom_id}
        elif isinstance(body, RequestValidationError):
            return _with_custom_id(body, custom_id)
        return body
    body = {}
    for name, value in record.items():
        if value is None or name == "custom_id":
            continue
        if isinstance(value, str) and name not in _TEXT_FIELDS:
            value = _decoded(value)
            if isinstance(value, RequestValidationError):
                error = RequestValidationError.single((name,), value.errors[0]["msg"], "json_invalid")
                return _with_custom_id(error, custom_id)
        body[name] = value
    if custom_id is not None:
        body["custom_id"] = custom_id
    return body


def _with_custom_id(error: RequestValidationError, custom_id: Any) -> RequestValidationError:
    error.custom_id = custom_id  # type: ignore[attr-defined]
    return error


# ------------------------------------------------------------------------------------------------ rows


def _row_of(line: int, data: Any) -> InputRow:
    """The input row of a decoded request: checked, without its ``custom_id``, with its state group."""
    if isinstance(data, RequestValidationError):
        custom_id = getattr(data, "custom_id", None)
        return InputRow(
            line, custom_id if is_valid_custom_id(custom_id) else None, None, json.dumps(error_object(data))
        )
    if not isinstance(data, dict):
        error = RequestValidationError.single(
            (), "a row must be a JSON object (a System One request)", "type"
        )
        return InputRow(line, None, None, json.dumps(error_object(error)))
    body = dict(data)
    custom_id = body.pop("custom_id", None)
    if custom_id is not None and not is_valid_custom_id(custom_id):
        error = custom_id_error()
        return InputRow(line, None, None, json.dumps(error_object(error)))
    try:
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:  # a Parquet value JSON cannot hold (bytes, a date, NaN)
        error = RequestValidationError.single((), f"the row is not a JSON request: {exc}", "type")
        return InputRow(line, custom_id, None, json.dumps(error_object(error)))
    return InputRow(line, custom_id, text, None, state_group(body))
