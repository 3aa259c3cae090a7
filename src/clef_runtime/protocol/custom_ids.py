"""``custom_id`` rules shared by the JSONL inputs (batch jobs, ``clef batch``): results are joined back to
their requests by ``custom_id``, so one input must not use an id twice (OpenAI's Batch API refuses it too).

Pure Python: no pydantic, no torch, no server import.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["duplicate_message", "first_duplicate"]


def first_duplicate(ids: Iterable[tuple[int, str | None]]) -> tuple[str, int, int] | None:
    """The first ``custom_id`` used twice in ``ids`` (``(line number, custom_id or None)`` pairs, in file
    order), as ``(custom_id, first line, repeated line)``; None when every id is distinct. Lines without an
    id (None) never clash. Stops at the first repeat, so a huge input with an early duplicate is not read to
    its end."""
    first_line: dict[str, int] = {}
    for line, custom_id in ids:
        if custom_id is None:
            continue
        if custom_id in first_line:
            return custom_id, first_line[custom_id], line
        first_line[custom_id] = line
    return None


def duplicate_message(custom_id: str, first_line: int) -> str:
    """What a repeated id's error says: the value and the line that used it first."""
    return f"custom_id {custom_id!r} repeats line {first_line}'s"
