"""OUTPUT: a folder of part files (Parquet, or JSONL with ``--format jsonl``) written by the driver alone,
and a manifest that lets a rerun resume.

Every commit writes one part file whole, named ``part-RRRR-NNNNNN.<ext>`` (run number, commit number): on a
filesystem to a hidden temporary name first, then renamed; on an object store (S3, GCS) with one PUT, which
is whole or absent. A process killed mid-write leaves at most a hidden temporary file, which readers skip
and the next run deletes; a committed part is complete. The driver keeps
the set of lines already committed and drops a row it has seen (a retried Ray task can hand a batch over
twice): each line is in OUTPUT exactly once.

The manifest (``_clef_batch.json``) records the input's digest, the model, the format and the runs; a rerun
with another input, model or format is refused rather than mixing answers of two jobs in one folder.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from clef_runtime.batch.inputs import InputError, Location, locate
from clef_runtime.batch.rows import OUTPUT_SCHEMA, OutputRow, output_table

__all__ = ["MANIFEST", "BatchOutput", "OutputConflictError", "OutputFormat", "read_output"]

OutputFormat = Literal["parquet", "jsonl"]
MANIFEST = "_clef_batch.json"
_MANIFEST_VERSION = 1
_TEMPORARY_PREFIX = ".tmp-"
_WHOLE_PUT_STORES = frozenset({"s3", "gcs"})
"""pyarrow filesystems (``type_name``) where an object appears whole or not at all."""


class OutputConflictError(InputError):
    """OUTPUT holds the results of another job (another input, model or format)."""


@dataclass
class BatchOutput:
    """An OUTPUT folder opened for a run: the lines already in it and the means to commit more."""

    location: Location
    format: OutputFormat
    run: int
    done: set[int] = field(default_factory=set)
    commits: int = 0
    manifest: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(cls, uri: str, *, fmt: OutputFormat, job: dict[str, Any]) -> BatchOutput:
        """Open (or create) ``uri`` for the job described by ``job`` (input digest, model, ...). Reads the
        lines already committed, deletes what an interrupted run left half-written, records this run. Raises
        `OutputConflictError` when the folder holds another job's results, `InputError` when it cannot be
        read or written."""
        location = locate(uri)
        filesystem = location.filesystem
        try:
            info = filesystem.get_file_info(location.path)
            if info.type == pafs.FileType.File:
                raise InputError(f"{uri} is a file: OUTPUT is a folder (created if needed)")
            filesystem.create_dir(location.path, recursive=True)
            manifest = _read_manifest(location)
            if manifest is None:
                if _entries(location):
                    raise OutputConflictError(
                        f"{uri} is not empty and holds no {MANIFEST}: it is not a clef batch output; "
                        "name a new folder"
                    )
                manifest = {"version": _MANIFEST_VERSION, "format": fmt, "job": job, "runs": []}
            _check_same_job(uri, manifest, fmt, job)
            output = cls(location, fmt, run=len(manifest["runs"]) + 1, manifest=manifest)
            output._remove_temporaries()
            output.done = output.committed_lines()
            manifest["runs"].append(
                {"run": output.run, "started": time.time(), "resumed_rows": len(output.done)}
            )
            output._write_manifest()
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"cannot use {uri} as OUTPUT: {exc}") from None
        return output

    def committed_lines(self) -> set[int]:
        """The lines of every committed part file."""
        lines: set[int] = set()
        for path in self.part_files():
            lines.update(_part_lines(self.location.filesystem, path, self.format))
        return lines

    def part_files(self) -> list[str]:
        """The committed part files, in name order."""
        suffix = ".parquet" if self.format == "parquet" else ".jsonl"
        return sorted(
            path
            for path in _entries(self.location)
            if _name(path).startswith("part-") and path.endswith(suffix)
        )

    def commit(self, rows: Iterable[OutputRow]) -> list[OutputRow]:
        """Write the rows not yet in OUTPUT as one part file; returns the rows written (repeats of a line
        already committed are dropped)."""
        fresh: list[OutputRow] = []
        for row in rows:
            if row.line not in self.done:
                self.done.add(row.line)
                fresh.append(row)
        if not fresh:
            return []
        self.commits += 1
        suffix = "parquet" if self.format == "parquet" else "jsonl"
        final = f"{self.location.path}/part-{self.run:04d}-{self.commits:06d}.{suffix}"
        filesystem = self.location.filesystem
        # An object store's PUT is whole or absent, and its "move" is a copy: write the final name directly
        # there; a filesystem gets a hidden temporary file renamed into place.
        direct = filesystem.type_name in _WHOLE_PUT_STORES
        target = final if direct else f"{self.location.path}/{_TEMPORARY_PREFIX}{uuid.uuid4().hex}.{suffix}"
        try:
            if self.format == "parquet":
                pq.write_table(output_table(fresh), target, filesystem=filesystem, compression="zstd")
            else:
                with filesystem.open_output_stream(target) as stream:
                    stream.write("".join(_jsonl_line(row) for row in fresh).encode())
            if not direct:
                filesystem.move(target, final)
        except BaseException:
            for row in fresh:
                self.done.discard(row.line)
            raise
        return fresh

    def finish(self, summary: dict[str, Any]) -> None:
        """Record this run's summary in the manifest."""
        self.manifest["runs"][-1].update(summary, finished=time.time())
        self._write_manifest()

    def _remove_temporaries(self) -> None:
        for path in _entries(self.location, hidden=True):
            if _name(path).startswith(_TEMPORARY_PREFIX):
                self.location.filesystem.delete_file(path)

    def _write_manifest(self) -> None:
        path = f"{self.location.path}/{MANIFEST}"
        temporary = f"{self.location.path}/{_TEMPORARY_PREFIX}{uuid.uuid4().hex}.json"
        with self.location.filesystem.open_output_stream(temporary) as stream:
            stream.write(json.dumps(self.manifest, indent=2).encode())
        self.location.filesystem.move(temporary, path)


def read_output(uri: str) -> list[OutputRow]:
    """Every committed row of a batch OUTPUT folder, in line order (for tests, tools and people)."""
    location = locate(uri)
    manifest = _read_manifest(location)
    if manifest is None:
        raise InputError(f"{uri} holds no {MANIFEST}: it is not a clef batch output")
    output = BatchOutput(location, manifest["format"], run=0)
    rows: list[OutputRow] = []
    for path in output.part_files():
        rows.extend(_part_rows(location.filesystem, path, output.format))
    return sorted(rows, key=lambda row: row.line)


def _check_same_job(uri: str, manifest: dict[str, Any], fmt: str, job: dict[str, Any]) -> None:
    written = manifest.get("format")
    if written != fmt:
        raise OutputConflictError(
            f"{uri} holds {written} results: resume with --format {written}, or name a new folder"
        )
    recorded = manifest.get("job", {})
    for key, value in job.items():
        if recorded.get(key) != value:
            raise OutputConflictError(
                f"{uri} holds the results of another job (its {key} was {recorded.get(key)!r}, this run's is "
                f"{value!r}): resuming would mix the two; name a new folder"
            )


def _read_manifest(location: Location) -> dict[str, Any] | None:
    path = f"{location.path}/{MANIFEST}"
    if location.filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with location.filesystem.open_input_stream(path) as stream:
        manifest: dict[str, Any] = json.loads(stream.read().decode())
    return manifest


def _entries(location: Location, *, hidden: bool = False) -> list[str]:
    selector = pafs.FileSelector(location.path, recursive=False, allow_not_found=True)
    paths = [
        entry.path
        for entry in location.filesystem.get_file_info(selector)
        if entry.type == pafs.FileType.File
    ]
    return [path for path in paths if hidden or not _name(path).startswith((".", "_"))]


def _name(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _jsonl_line(row: OutputRow) -> str:
    """A JSONL output line: the jobs route's result shape (``response`` and ``error`` as JSON objects)."""
    item: dict[str, Any] = {"custom_id": row.custom_id, "line": row.line}
    if row.response is not None:
        item["response"] = json.loads(row.response)
    else:
        item["error"] = json.loads(row.error or "{}")
    return json.dumps(item, ensure_ascii=False, separators=(",", ":")) + "\n"


def _part_rows(filesystem: pafs.FileSystem, path: str, fmt: str) -> list[OutputRow]:
    if fmt == "parquet":
        table = pq.read_table(path, filesystem=filesystem, schema=OUTPUT_SCHEMA)
        return [OutputRow(**record) for record in table.to_pylist()]
    rows = []
    with filesystem.open_input_stream(path) as stream:
        for text in stream.read().decode().splitlines():
            item = json.loads(text)
            response = item.get("response")
            error = item.get("error")
            rows.append(
                OutputRow(
                    item.get("custom_id"),
                    item["line"],
                    json.dumps(response, ensure_ascii=False, separators=(",", ":"))
                    if response is not None
                    else None,
                    json.dumps(error, ensure_ascii=False) if error is not None else None,
                    response.get("x_state_cache") if isinstance(response, dict) else None,
                )
            )
    return rows


def _part_lines(filesystem: pafs.FileSystem, path: str, fmt: str) -> Sequence[int]:
    if fmt == "parquet":
        lines: list[int] = (
            pq.read_table(path, filesystem=filesystem, columns=["line"]).column("line").to_pylist()
        )
        return lines
    return [row.line for row in _part_rows(filesystem, path, fmt)]
