"""`first_duplicate`: the first custom_id used twice, with the line that used it first and the repeat."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clef_runtime.protocol.custom_ids import duplicate_message, first_duplicate


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([], None),
        ([(1, "a"), (2, "b"), (3, "c")], None),
        ([(1, None), (2, None), (3, "a")], None),  # lines without an id never clash
        ([(1, "a"), (2, "b"), (4, "a")], ("a", 1, 4)),
        ([(3, "x"), (5, None), (6, "y"), (9, "y"), (12, "x")], ("y", 6, 9)),  # the first repeat in file order
        ([(1, "a"), (2, "A"), (3, "a ")], None),  # ids are compared exactly
        ([(1, "a"), (2, "a"), (3, "a")], ("a", 1, 2)),
    ],
)
def test_first_duplicate(ids: list[tuple[int, str | None]], expected: tuple[str, int, int] | None) -> None:
    assert first_duplicate(ids) == expected


def test_first_duplicate_stops_at_the_first_repeat() -> None:
    read: list[int] = []

    def ids() -> Iterator[tuple[int, str | None]]:
        for line in range(1, 1_000):
            read.append(line)
            yield line, "same" if line in (2, 5) else f"id-{line}"

    assert first_duplicate(ids()) == ("same", 2, 5)
    assert read == [1, 2, 3, 4, 5]


def test_duplicate_message_names_the_value_and_the_first_line() -> None:
    assert duplicate_message("a-1", 3) == "custom_id 'a-1' repeats line 3's"
