"""Batch planning for the backbone: which rows share a start, what each runs from where, where snapshots go.

Pure and model-free: it sees each row's positions (state start and end, the unstable tail) and where the
state cache lets it resume, and returns a `Plan` that `clef_runtime.engine.clef.Clef` executes. Positions
are absolute indexes into the row's ids: ``prefix + [images] + state + schema + suffix``.

1. Rows with the same state (`PlanRow.state_key`) form a group computed once. A group whose whole state is
   cached (``resume_at == state_end``) is a *hit*: its rows only run their schema and suffix (`Finish`).
   Otherwise its first row (the representative) runs from ``resume_at`` to its end (*partial* when something
   was reused, *miss* when it starts at the prompt prefix), and the group's other rows finish from the state
   end it computes (they are *hits* served by the batch: ``shared``).
2. Representatives that resume at the same cached point run as one batched call (`Run`).
3. Snapshots (`RowRun.points`) of a stored row: the state end (as before the prefix tree), every
   ``snapshot_interval`` state tokens inside the state (counted from the state's start, so an extension puts
   its boundaries at the same places), just before the unstable tail (`clef_runtime.encoding.growth`: an
   extended state diverges there), and after the image block when it is not cached yet (another state
   about the same images resumes there). A row whose state is shared in the batch always snapshots its
   state end (its group finishes from it). Every snapshot position splits the call there, so at most
   ``max_snapshot_rows`` rows of a call store snapshots (shared rows first, then in batch order).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["Finish", "Plan", "PlanRow", "RowReport", "RowRun", "Run", "plan_batch"]

MAX_SNAPSHOT_ROWS = 4
"""Default: most rows of one call that store snapshots."""


@dataclass(frozen=True)
class PlanRow:
    """One request of the batch, as the planner sees it.

    ``resume_at``: where the state cache lets the row resume (the prompt prefix's length when nothing is
    cached; ``state_end`` for a whole cached state); ``start``: the identity of that cached point (rows with
    equal starts can share a call). ``tail_at``: where the state's unstable tail starts (None: unknown).
    ``images``: the row has image blocks (between the prompt prefix and ``state_start``).
    """

    state_key: bytes
    state_start: int
    state_end: int
    resume_at: int
    start: Hashable
    tail_at: int | None = None
    images: bool = False


@dataclass(frozen=True)
class RowRun:
    """A row run from its `Run`'s start to its end; ``points``: absolute positions where snapshots are
    taken (increasing, after the start, the last one the state end); ``store``: they go to the cache."""

    row: int
    points: tuple[int, ...] = ()
    store: bool = False


@dataclass(frozen=True)
class Run:
    """One batched backbone call: ``rows`` all resume at the cached point ``start`` (position
    ``start_at``)."""

    start: Hashable
    start_at: int
    rows: tuple[RowRun, ...]


@dataclass(frozen=True)
class Finish:
    """Rows of one group that run only their schema and suffix from the state end (``at``): from the
    cached point ``start``, or, when ``start`` is None, from the state end the group's representative
    computes in this batch (row ``source``)."""

    state_key: bytes
    at: int
    rows: tuple[int, ...]
    start: Hashable | None = None
    source: int | None = None


@dataclass(frozen=True)
class RowReport:
    """What the cache did for a row: ``status`` ``"hit"`` (the whole state reused, from the cache or from
    another row of the batch), ``"partial"`` or ``"miss"``; ``cached_tokens``: image and state tokens
    reused (what ``usage.input_tokens_details.cached_tokens`` reports; the always-cached prompt prefix is
    not counted)."""

    status: str
    cached_tokens: int


@dataclass(frozen=True)
class Plan:
    """The batch's plan: `Run` calls first, then `Finish` calls; one `RowReport` per row; per distinct
    state ``hits`` / ``partials`` / ``misses``; ``shared``: rows served by a state computed in the batch."""

    runs: tuple[Run, ...]
    finishes: tuple[Finish, ...]
    reports: tuple[RowReport, ...]
    hits: int = 0
    partials: int = 0
    misses: int = 0
    shared: int = 0


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


def plan_batch(
    rows: Sequence[PlanRow],
    *,
    prefix_length: int,
    store: bool,
    snapshot_interval: int = 0,
    max_snapshot_rows: int = MAX_SNAPSHOT_ROWS,
) -> Plan:
    """Plan ``rows`` (see the module docstring). ``store``: the cache keeps snapshots (False: only the
    state ends that rows of the batch share are taken). Returns the `Plan`. Raises ValueError for a row
    whose positions are out of order."""
    groups: dict[bytes, list[int]] = {}
    for index, row in enumerate(rows):
        if not prefix_length <= row.state_start <= row.state_end or not (
            prefix_length <= row.resume_at <= row.state_end
        ):
            raise ValueError(f"row {index}: positions out of order: {row}")
        groups.setdefault(row.state_key, []).append(index)

    reports: list[RowReport | None] = [None] * len(rows)
    finishes: list[Finish] = []
    by_start: dict[Hashable, list[tuple[int, bool]]] = {}
    hits = partials = misses = shared = 0
    for key, members in groups.items():
        first = rows[members[0]]
        whole = RowReport("hit", first.state_end - prefix_length)
        if first.resume_at >= first.state_end:
            hits += 1
            finishes.append(Finish(key, first.state_end, tuple(members), start=first.start))
            for index in members:
                reports[index] = whole
            continue
        representative, others = members[0], members[1:]
        if first.resume_at > prefix_length:
            partials += 1
            reports[representative] = RowReport("partial", first.resume_at - prefix_length)
        else:
            misses += 1
            reports[representative] = RowReport("miss", 0)
        by_start.setdefault(first.start, []).append((representative, bool(others)))
        if others:
            shared += len(others)
            finishes.append(Finish(key, first.state_end, tuple(others), source=representative))
            for index in others:
                reports[index] = whole

    runs = []
    for start, members in by_start.items():
        # Shared rows must snapshot their state end; they take their share of the bound first.
        budget = max_snapshot_rows - sum(is_shared for _, is_shared in members)
        planned = []
        for index, is_shared in members:
            row = rows[index]
            keep = store and (is_shared or budget > 0)
            if keep and not is_shared:
                budget -= 1
            points = _snapshot_points(row, snapshot_interval) if keep else set()
            if keep or is_shared:
                points.add(row.state_end)
            planned.append(RowRun(index, tuple(sorted(points)), keep))
        runs.append(Run(start, rows[members[0][0]].resume_at, tuple(planned)))

    complete = [r for r in reports if r is not None]
    assert len(complete) == len(rows)
    return Plan(
        runs=tuple(runs),
        finishes=tuple(finishes),
        reports=tuple(complete),
        hits=hits,
        partials=partials,
        misses=misses,
        shared=shared,
    )
