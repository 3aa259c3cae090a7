"""Grouping: rows about the same state go into the same batch, so the worker that answers the batch computes
the state once and answers the other rows from its state cache.

Three ways to cut the pending rows into batches of at most ``batch_rows`` rows, all on the driver (it holds
every row already, after the duplicate check):

- ``sort`` (the default): a stable sort by state group, then cuts between groups where possible. A group
  longer than a batch spans consecutive batches; the input order is kept within a group.
- ``partition``: a hash partition into ``ceil(rows / batch_rows)`` buckets by state group (what a
  distributed ``groupby`` shuffle does); buckets vary in size, a full one is cut between groups as ``sort``
  cuts.
- ``none``: input order, for comparison.

``benchmarks/bench_batch.py`` measures the three (state-cache hits, batches formed, time to group).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Literal

import pyarrow as pa

__all__ = ["GROUPINGS", "Grouping", "group_batches"]

Grouping = Literal["sort", "partition", "none"]
GROUPINGS: tuple[Grouping, ...] = ("sort", "partition", "none")


def group_batches(table: pa.Table, batch_rows: int, grouping: Grouping = "sort") -> list[pa.Table]:
    """``table`` (`clef_runtime.batch.rows.INPUT_SCHEMA`) cut into batches of at most ``batch_rows`` rows."""
    if batch_rows < 1:
        raise ValueError("batch_rows must be at least 1")
    if table.num_rows == 0:
        return []
    if grouping == "none":
        return _cut(table, _even_cuts(table.num_rows, batch_rows))
    if grouping == "sort":
        # Stable: the line order is kept within a group (pyarrow's sort is stable on ties with "line").
        ordered = table.sort_by([("group", "ascending"), ("line", "ascending")])
        return _cut(ordered, _group_cuts(ordered.column("group").to_pylist(), batch_rows))
    if grouping == "partition":
        return _partition(table, batch_rows)
    raise ValueError(f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")


def _even_cuts(rows: int, batch_rows: int) -> list[int]:
    return list(range(batch_rows, rows, batch_rows))


def _group_cuts(groups: Sequence[str], batch_rows: int) -> list[int]:
    """Where to cut a sorted column of groups: a batch ends at the last group boundary before it would
    exceed ``batch_rows`` (or at ``batch_rows`` itself when one group fills it)."""
    cuts: list[int] = []
    start = 0
    boundary = None  # the last group boundary after ``start``
    for index in range(1, len(groups) + 1):
        if index < len(groups) and groups[index] != groups[index - 1]:
            boundary = index
        if index - start == batch_rows and index < len(groups):
            cut = boundary if boundary is not None and boundary > start else index
            cuts.append(cut)
            start = cut
            boundary = None
    return cuts


def _cut(table: pa.Table, cuts: Sequence[int]) -> list[pa.Table]:
    edges = [0, *cuts, table.num_rows]
    return [table.slice(begin, end - begin) for begin, end in itertools.pairwise(edges) if end > begin]


def _partition(table: pa.Table, batch_rows: int) -> list[pa.Table]:
    buckets = math.ceil(table.num_rows / batch_rows)
    numbers = pa.array([_bucket(group, buckets) for group in table.column("group").to_pylist()], pa.int64())
    # One sort by (bucket, group, line) instead of a filter per bucket: linear in the buckets, not quadratic.
    ordered = table.append_column("bucket", numbers).sort_by(
        [("bucket", "ascending"), ("group", "ascending"), ("line", "ascending")]
    )
    bucket_of = ordered.column("bucket").to_pylist()
    groups = ordered.column("group").to_pylist()
    ordered = ordered.drop_columns(["bucket"])
    batches: list[pa.Table] = []
    start = 0
    for end in range(1, len(bucket_of) + 1):
        if end == len(bucket_of) or bucket_of[end] != bucket_of[start]:
            part = ordered.slice(start, end - start)
            batches.extend(_cut(part, _group_cuts(groups[start:end], batch_rows)))
            start = end
    return batches


def _bucket(group: str, buckets: int) -> int:
    return int.from_bytes(hashlib.blake2b(group.encode(), digest_size=8).digest(), "big") % buckets
