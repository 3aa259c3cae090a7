"""The per-request context: one typed record a request carries from the middleware to its log line.

The middleware (`clef_runtime.server.middleware`) gives every request a `RequestContext` (its id, when it
arrived, the caller's rate-limit headers) and writes one log line from the fields the handlers filled in.
Handlers reach the record with `context_of(request)`; a field they set is a field of the log line, named
the same.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import HTTPConnection

__all__ = ["RequestContext", "context_of", "start_context"]

# Where the record lives in the ASGI scope's state (Starlette's ``request.state`` reads the same dict).
_STATE_KEY = "clef_context"


@dataclass
class RequestContext:
    """What the server knows of one request besides its body; `LOG_FIELDS` are the log line's
    (``key=value``, each only once set)."""

    request_id: str
    started_at: float
    """``time.perf_counter()`` when the request arrived."""
    rate_limit_headers: dict[str, str] = field(default_factory=dict)
    """The caller's ``X-RateLimit-*`` headers, put on the response whatever its status."""
    key: str | None = None
    """The name of the API key that authenticated the request (never the key)."""
    head: str | None = None
    """``name@digest12`` of the head that answered (or that a head route loaded or unloaded)."""
    input_tokens: int | None = None
    questions: int | None = None
    truncated_state_tokens: int | None = None
    state_cache: str | None = None
    steps: int | None = None
    error_type: str | None = None
    caller: str | None = None
    """The rate-limited caller's label (a key name or ``anonymous``), for a refused request."""

    def log_fields(self) -> list[str]:
        """The ``key=value`` parts of the log line, in this order, for the fields that were set."""
        return [f"{name}={value}" for name in LOG_FIELDS if (value := getattr(self, name)) is not None]


LOG_FIELDS = (
    "key",
    "head",
    "input_tokens",
    "questions",
    "truncated_state_tokens",
    "state_cache",
    "steps",
    "error_type",
)
"""The request's fields its log line shows, in order (``caller`` labels metrics only)."""


def start_context(scope: MutableMapping[str, Any], request_id: str, started_at: float) -> RequestContext:
    """Give a request (its ASGI scope) its context; the middleware's first step."""
    context = RequestContext(request_id, started_at)
    scope.setdefault("state", {})[_STATE_KEY] = context
    return context


def context_of(request: HTTPConnection) -> RequestContext:
    """The request's context. A request that did not pass the middleware (a handler called directly) gets
    a fresh one, kept for the rest of the request."""
    context = request.scope.get("state", {}).get(_STATE_KEY)
    if isinstance(context, RequestContext):
        return context
    return start_context(request.scope, uuid.uuid4().hex, time.perf_counter())
