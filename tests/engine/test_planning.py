"""The row planner: pure decisions about cache reports and snapshot positions (no model)."""

from __future__ import annotations

import pytest

from clef_runtime.engine.decision import CacheReport
from clef_runtime.engine.planning import PlanRow, plan_rows

P = 36  # the prompt prefix


def row(end: int, *, resume: int = P, **extra: object) -> PlanRow:
    return PlanRow(
        state_start=extra.pop("state_start", P),  # type: ignore[arg-type]
        state_end=end,
        resume_at=resume,
        **extra,  # type: ignore[arg-type]
    )


def test_cold_rows_snapshot_their_ends_and_are_misses() -> None:
    plans = plan_rows([row(100), row(80)], prefix_length=P, store=True)
    assert [(p.points, p.store, p.report) for p in plans] == [
        ((100,), True, CacheReport("miss", 0)),
        ((80,), True, CacheReport("miss", 0)),
    ]


def test_reports_hit_partial_miss() -> None:
    plans = plan_rows([row(120, resume=120), row(300, resume=200), row(150)], prefix_length=P, store=True)
    assert [p.report for p in plans] == [
        CacheReport("hit", 84),
        CacheReport("partial", 164),
        CacheReport("miss", 0),
    ]
    assert plans[0].points == ()  # a hit computes no state: nothing to snapshot


def test_without_storing_only_a_shared_state_end_is_snapshotted() -> None:
    plans = plan_rows([row(100, share=True), row(90)], prefix_length=P, store=False, snapshot_interval=16)
    assert [(p.points, p.store) for p in plans] == [((100,), False), ((), False)]


def test_snapshot_points_boundaries_tail_and_image_block() -> None:
    (long,) = plan_rows(
        [row(36 + 1300, tail_at=36 + 1297)], prefix_length=P, store=True, snapshot_interval=512
    )
    assert long.points == (36 + 512, 36 + 1024, 36 + 1297, 36 + 1300)
    # Resumed at 600: only what lies after the start; boundaries stay on the state's grid.
    (resumed,) = plan_rows(
        [row(36 + 1300, resume=600, tail_at=36 + 1297)], prefix_length=P, store=True, snapshot_interval=512
    )
    assert resumed.points == (36 + 1024, 36 + 1297, 36 + 1300)
    # Image rows: the block alone is kept when it is not cached yet, so other states about it resume there.
    (image,) = plan_rows([row(200, state_start=110, images=True)], prefix_length=P, store=True)
    assert image.points == (110, 200)
    (cached_block,) = plan_rows(
        [row(200, state_start=110, images=True, resume=110)], prefix_length=P, store=True
    )
    assert cached_block.points == (200,) and cached_block.report == CacheReport("partial", 74)


def test_the_number_of_storing_rows_per_batch_is_bounded_shared_rows_first() -> None:
    rows = [row(100 + i, tail_at=98 + i) for i in range(7)] + [row(106, share=True)]
    plans = plan_rows(rows, prefix_length=P, store=True, max_snapshot_rows=3)
    stored = [i for i, p in enumerate(plans) if p.store]
    assert stored == [0, 1, 7]  # the shared row takes its share of the bound first; then batch order
    assert all(p.points == () for p in plans if not p.store)
    assert len({point for p in plans for point in p.points}) <= 2 * 3


def test_empty_state_is_a_hit_at_the_prefix() -> None:
    (plan,) = plan_rows([row(P)], prefix_length=P, store=True)
    assert plan.points == () and plan.report == CacheReport("hit", 0)


def test_out_of_order_positions_are_refused() -> None:
    with pytest.raises(ValueError, match="row 0"):
        plan_rows([row(100, resume=120)], prefix_length=P, store=True)
    with pytest.raises(ValueError, match="row 0"):
        plan_rows([row(20)], prefix_length=P, store=True)
