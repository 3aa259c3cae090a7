"""Grouping pending rows into batches so that rows about one state share a batch."""

from __future__ import annotations

from collections import Counter

import pytest

from clef_runtime.batch.grouping import GROUPINGS, group_batches
from clef_runtime.batch.rows import InputRow, input_table


def _table(groups: list[str]) -> object:
    return input_table(
        [InputRow(line, None, "{}", None, group) for line, group in enumerate(groups, start=1)]
    )


def _split_groups(batches: list) -> set[str]:
    """Groups whose rows landed in more than one batch."""
    seen: Counter[str] = Counter()
    for batch in batches:
        for group in set(batch.column("group").to_pylist()):
            seen[group] += 1
    return {group for group, count in seen.items() if count > 1}


GROUPS = [f"g{i % 7}" for i in range(40)]  # 7 states, each spread over the input


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_every_row_is_in_exactly_one_batch_of_at_most_batch_rows(grouping: str) -> None:
    batches = group_batches(_table(GROUPS), 8, grouping)  # type: ignore[arg-type]
    lines = [line for batch in batches for line in batch.column("line").to_pylist()]
    assert sorted(lines) == list(range(1, 41))
    assert all(0 < batch.num_rows <= 8 for batch in batches)


@pytest.mark.parametrize("grouping", ["sort", "partition"])
def test_grouping_keeps_each_state_in_one_batch(grouping: str) -> None:
    # Each state has 5-6 rows, fewer than a batch: none needs to be split.
    assert _split_groups(group_batches(_table(GROUPS), 8, grouping)) == set()  # type: ignore[arg-type]
    # The negative control: in input order every state is spread over several batches.
    assert _split_groups(group_batches(_table(GROUPS), 8, "none")) == {f"g{i}" for i in range(7)}


def test_sort_splits_only_a_state_larger_than_a_batch_and_keeps_input_order_within_it() -> None:
    groups = ["big"] * 10 + ["small"] * 3
    batches = group_batches(_table(groups[::-1]), 4, "sort")
    assert _split_groups(batches) == {"big"}
    big_lines = [
        line
        for b in batches
        for line, g in zip(b.column("line").to_pylist(), b.column("group").to_pylist(), strict=True)
        if g == "big"
    ]
    assert big_lines == sorted(big_lines)


def test_a_bad_batch_size_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_rows"):
        group_batches(_table(GROUPS), 0)
