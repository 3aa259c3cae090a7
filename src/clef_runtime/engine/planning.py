"""Row planning for the backbone: what the state cache did for each row of a batch being admitted, and where
each row takes its snapshots. Pure and model-free.

A row is ``prefix + [images] + state + schema + suffix``; positions are absolute indexes into its ids. The
state cache says where it can resume (``resume_at``): the prompt prefix's length when nothing is cached,
``state_end`` for a whole cached state (a *hit*: the row runs only its schema and suffix), anything between
for a cached prefix of the state (a *partial*).

Snapshots (`RowPlan.points`) of a row that stores: the state end, every ``snapshot_interval`` state tokens
inside the state (counted from the state's start, so an extension puts its boundaries at the same places),
just before the unstable tail (`clef_runtime.encoding.growth`: an extended state diverges there), and after
the image block when it is not cached yet (another state about the same images resumes there). Every
snapshot position splits the batch's model calls there, so at most ``max_snapshot_rows`` rows of a batch
store snapshots: rows whose state another request is waiting for (``share``) first, then in batch order. A
row that shares its state always snapshots its state end, even when the cache stores nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clef_runtime.engine.decision import CacheReport

__all__ = ["MAX_SNAPSHOT_ROWS", "PlanRow", "RowPlan", "plan_rows"]

MAX_SNAPSHOT_ROWS = 4
"""Default: most rows of one batch that store snapshots."""


@dataclass(frozen=True)
class PlanRow:
    """One row of a batch being admitted, as the planner sees it.

    ``resume_at``: where the state cache lets the row resume; ``tail_at``: where the state's unstable tail
    starts (None: unknown); ``images``: the row has image blocks (between the prompt prefix and
    ``state_start``); ``share``: another request waits for this row's state.
    """

    state_start: int
    state_end: int
    resume_at: int
    tail_at: int | None = None
    images: bool = False
    share: bool = False


@dataclass(frozen=True)
class RowPlan:
    """A row's plan: ``points`` (absolute positions after ``resume_at`` where snapshots are taken,
    increasing, the last one the state end), ``store`` (they go to the state cache) and ``report``."""

    points: tuple[int, ...]
    store: bool
    report: CacheReport


def _snapshot_points(row: PlanRow, interval: int) -> set[int]:
    """Positions after ``row.resume_at`` where a stored row keeps a snapshot (the state end excluded)."""
    points: set[int] = set()
    if row.images and row.resume_at < row.state_start:
        points.add(row.state_start)  # the image block alone: other states about these images resume here
    if interval > 0:
        points.update(range(row.state_start + interval, row.state_end, interval))
    if row.tail_at is not None:
        points.add(row.tail_at)
    return {p for p in points if row.resume_at < p < row.state_end}


def _report(row: PlanRow, prefix_length: int) -> CacheReport:
    if row.resume_at >= row.state_end:
        return CacheReport("hit", row.state_end - prefix_length)
    if row.resume_at > prefix_length:
        return CacheReport("partial", row.resume_at - prefix_length)
    return CacheReport("miss", 0)


def plan_rows(
    rows: Sequence[PlanRow],
    *,
    prefix_length: int,
    store: bool,
    snapshot_interval: int = 0,
    max_snapshot_rows: int = MAX_SNAPSHOT_ROWS,
) -> list[RowPlan]:
    """Plan the rows of one batch (see the module docstring). ``store``: the cache keeps snapshots.
    Returns one `RowPlan` per row. Raises ValueError for a row whose positions are out of order."""
    for index, row in enumerate(rows):
        if not prefix_length <= row.state_start <= row.state_end or not (
            prefix_length <= row.resume_at <= row.state_end
        ):
            raise ValueError(f"row {index}: positions out of order: {row}")
    computing = [row.resume_at < row.state_end for row in rows]
    budget = max_snapshot_rows - sum(1 for row, c in zip(rows, computing, strict=True) if c and row.share)
    plans = []
    for row, computes in zip(rows, computing, strict=True):
        keep = computes and store and (row.share or budget > 0)
        if keep and not row.share:
            budget -= 1
        points = _snapshot_points(row, snapshot_interval) if keep else set()
        if computes and (keep or row.share):
            points.add(row.state_end)
        plans.append(RowPlan(tuple(sorted(points)), keep, _report(row, prefix_length)))
    return plans
