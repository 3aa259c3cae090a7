"""System One wire types and validation (pydantic only; no torch)."""

from clef_runtime.protocol.errors import ClefError, InputTooLongError, RequestValidationError
from clef_runtime.protocol.systemone import SystemOneRequest, SystemOneResponse, parse_request

__all__ = [
    "ClefError",
    "InputTooLongError",
    "RequestValidationError",
    "SystemOneRequest",
    "SystemOneResponse",
    "parse_request",
]
