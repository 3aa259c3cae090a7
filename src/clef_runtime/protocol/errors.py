"""The one exception hierarchy of clef-runtime's request handling.

The server maps these to HTTP once (422 / 413 / ...); the CLI maps them to exit status 2. Nothing here knows
about HTTP or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "ClefError",
    "ErrorItem",
    "InputTooLongError",
    "RequestValidationError",
    "format_loc",
]

ErrorItem = dict[str, Any]
"""One validation problem: ``{"loc": tuple[str | int, ...], "msg": str, "type": str}``."""


class ClefError(Exception):
    """Base class of every error clef-runtime reports to a caller.

    ``error_type`` is the machine-readable kind used in System One error bodies.
    """

    error_type: str = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def format_loc(loc: Sequence[str | int]) -> str:
    """Render a location tuple the way users read it: ``questions.q1.criteria[2]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def _printable(value: Any) -> Any:
    """``value`` with any surrogate code point written as ``\\udXXX``: an error names the field whose text is
    not valid Unicode, and its own location and message must still encode as UTF-8."""
    if isinstance(value, str) and not value.isascii():
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


class RequestValidationError(ClefError):
    """The request is invalid. ``errors`` lists every problem found, each naming its field.

    Locations never start with ``"body"``; the HTTP layer prefixes it.
    """

    error_type = "invalid_request_error"

    def __init__(self, errors: Iterable[ErrorItem]) -> None:
        self.errors: list[ErrorItem] = [
            {
                "loc": tuple(_printable(part) for part in e["loc"]),
                "msg": _printable(str(e["msg"])),
                "type": str(e["type"]),
            }
            for e in errors
        ]
        if not self.errors:
            raise ValueError("RequestValidationError needs at least one error")
        first = self.errors[0]
        summary = f"{format_loc(first['loc'])}: {first['msg']}"
        if len(self.errors) > 1:
            summary += f" (and {len(self.errors) - 1} more)"
        super().__init__(summary)

    @classmethod
    def single(cls, loc: Sequence[str | int], msg: str, type_: str) -> RequestValidationError:
        """One error at ``loc``."""
        return cls([{"loc": tuple(loc), "msg": msg, "type": type_}])


class InputTooLongError(RequestValidationError):
    """The encoded request does not fit: the schema alone exceeds ``max_length``, or the whole input exceeds
    the server's input-token limit and the server is told to reject instead of truncating the state."""

    error_type = "tokens_exceeded"

    def __init__(self, loc: Sequence[str | int], msg: str, *, input_tokens: int, limit: int) -> None:
        self.input_tokens = input_tokens
        self.limit = limit
        super().__init__([{"loc": tuple(loc), "msg": msg, "type": "tokens_exceeded"}])
