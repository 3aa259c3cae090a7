"""``custom_id`` rules shared by the JSONL inputs (batch jobs, ``clef batch``): results are joined back to
their requests by ``custom_id``, so one input must not use an id twice (OpenAI's Batch API refuses it too).

Pure Python beside the protocol's error type: no pydantic model, no torch, no server import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from clef_runtime.protocol.errors import RequestValidationError

__all__ = [
    "CUSTOM_ID_MAX_CHARS",
    "custom_id_error",
    "duplicate_message",
    "first_duplicate",
    "is_valid_custom_id",
]

CUSTOM_ID_MAX_CHARS = 256


def is_valid_custom_id(value: Any) -> bool:
    """Whether ``value`` is a usable ``custom_id``: a string of 1-`CUSTOM_ID_MAX_CHARS` characters."""
    return isinstance(value, str) and 1 <= len(value) <= CUSTOM_ID_MAX_CHARS


def custom_id_error() -> RequestValidationError:
    """The error of a line whose ``custom_id`` is not `is_valid_custom_id`, naming the field."""
    return RequestValidationError.single(
        ("custom_id",), f"custom_id must be a string of 1-{CUSTOM_ID_MAX_CHARS} characters", "string_type"
    )


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
