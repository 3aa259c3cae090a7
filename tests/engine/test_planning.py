"""The batch planner: pure decisions about grouping, starts and snapshot positions (no model)."""

from __future__ import annotations

import pytest

from clef_runtime.engine.planning import Finish, PlanRow, RowReport, plan_batch

P = 36  # the prompt prefix


def row(key: str, end: int, *, resume: int = P, start: object = "prefix", **extra: object) -> PlanRow:
    return PlanRow(
        state_key=key.encode(),
        state_start=extra.pop("state_start", P),  # type: ignore[arg-type]
        state_end=end,
        resume_at=resume,
        start=start,
        **extra,  # type: ignore[arg-type]
    )


def test_cold_rows_share_one_call_from_the_prefix_and_snapshot_their_ends() -> None:
    plan = plan_batch([row("a", 100), row("b", 80)], prefix_length=P, store=True)
    assert len(plan.runs) == 1 and plan.runs[0].start_at == P
    assert [(r.row, r.points, r.store) for r in plan.runs[0].rows] == [(0, (100,), True), (1, (80,), True)]
    assert plan.finishes == ()
    assert plan.reports == (RowReport("miss", 0), RowReport("miss", 0))
    assert (plan.hits, plan.partials, plan.misses, plan.shared) == (0, 0, 2, 0)


def test_a_state_shared_in_the_batch_is_computed_once() -> None:
    plan = plan_batch([row("a", 100), row("b", 90), row("a", 100)], prefix_length=P, store=False)
    (run,) = plan.runs
    # Without storing, only the shared state's end is snapshotted (its group finishes from it).
    assert [(r.row, r.points, r.store) for r in run.rows] == [(0, (100,), False), (1, (), False)]
    assert plan.finishes == (Finish(b"a", 100, (2,), source=0),)
    assert plan.reports[2] == RowReport("hit", 100 - P)
    assert plan.shared == 1 and plan.misses == 2


def test_cached_states_finish_from_their_point_and_partials_resume_where_found() -> None:
    rows = [
        row("hit", 120, resume=120, start="n1"),
        row("grown", 300, resume=200, start="n2"),
        row("grown too", 310, resume=200, start="n2"),
        row("hit", 120, resume=120, start="n1"),
        row("other", 150, resume=90, start="n3"),
    ]
    plan = plan_batch(rows, prefix_length=P, store=True)
    assert plan.finishes == (Finish(b"hit", 120, (0, 3), start="n1"),)
    assert [(run.start, run.start_at, [r.row for r in run.rows]) for run in plan.runs] == [
        ("n2", 200, [1, 2]),
        ("n3", 90, [4]),
    ]
    assert [r.status for r in plan.reports] == ["hit", "partial", "partial", "hit", "partial"]
    assert [r.cached_tokens for r in plan.reports] == [84, 164, 164, 84, 54]
    assert (plan.hits, plan.partials, plan.misses) == (1, 3, 0)


def test_snapshot_points_boundaries_tail_and_image_block() -> None:
    long = row("long", 36 + 1300, tail_at=36 + 1297)
    (run,) = plan_batch([long], prefix_length=P, store=True, snapshot_interval=512).runs
    assert run.rows[0].points == (36 + 512, 36 + 1024, 36 + 1297, 36 + 1300)
    # Resumed at 600: only what lies after the start; boundaries stay on the state's grid.
    resumed = row("long", 36 + 1300, resume=600, start="n", tail_at=36 + 1297)
    (run,) = plan_batch([resumed], prefix_length=P, store=True, snapshot_interval=512).runs
    assert run.rows[0].points == (36 + 1024, 36 + 1297, 36 + 1300)
    # Image rows: the block alone is kept when it is not cached yet, so other states about it resume there.
    image = row("img", 200, state_start=110, images=True)
    (run,) = plan_batch([image], prefix_length=P, store=True, snapshot_interval=0).runs
    assert run.rows[0].points == (110, 200)
    cached_block = row("img", 200, state_start=110, images=True, resume=110, start="root")
    (run,) = plan_batch([cached_block], prefix_length=P, store=True).runs
    assert run.start_at == 110 and run.rows[0].points == (200,)
    assert plan_batch([cached_block], prefix_length=P, store=True).reports[0] == RowReport("partial", 74)


def test_the_number_of_storing_rows_per_call_is_bounded() -> None:
    rows = [row(f"s{i}", 100 + i, tail_at=98 + i) for i in range(7)] + [row("s6", 106)]
    plan = plan_batch(rows, prefix_length=P, store=True, max_snapshot_rows=3)
    (run,) = plan.runs
    stored = [r.row for r in run.rows if r.store]
    # The shared state (s6) is always stored and counts against the bound; then batch order.
    assert stored == [0, 1, 6]
    assert all(r.points == () for r in run.rows if not r.store)
    assert len({p for r in run.rows for p in r.points}) <= 2 * 3


def test_empty_state_is_a_hit_at_the_prefix() -> None:
    plan = plan_batch([row("empty", P)], prefix_length=P, store=True)
    assert plan.runs == () and plan.finishes == (Finish(b"empty", P, (0,), start="prefix"),)
    assert plan.reports == (RowReport("hit", 0),)


def test_out_of_order_positions_are_refused() -> None:
    with pytest.raises(ValueError, match="row 0"):
        plan_batch([row("a", 100, resume=120)], prefix_length=P, store=True)
    with pytest.raises(ValueError, match="row 0"):
        plan_batch([row("a", 20)], prefix_length=P, store=True)
