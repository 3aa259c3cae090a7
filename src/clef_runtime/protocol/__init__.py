"""System One wire types and validation (pydantic only; no torch).

The names below are imported on first use, so that ``clef_runtime.protocol.errors`` (all the CLI needs to
start) does not pay for importing pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clef_runtime.protocol.errors import ClefError, InputTooLongError, RequestValidationError

if TYPE_CHECKING:
    from clef_runtime.protocol.systemone import SystemOneRequest, SystemOneResponse, parse_request

__all__ = [
    "ClefError",
    "InputTooLongError",
    "RequestValidationError",
    "SystemOneRequest",
    "SystemOneResponse",
    "parse_request",
]

_FROM_SYSTEMONE = frozenset({"SystemOneRequest", "SystemOneResponse", "parse_request"})


def __getattr__(name: str) -> Any:
    if name in _FROM_SYSTEMONE:
        from clef_runtime.protocol import systemone

        return getattr(systemone, name)
    raise AttributeError(f"module 'clef_runtime.protocol' has no attribute {name!r}")
