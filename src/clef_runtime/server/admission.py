"""A decision route's first step: who is calling (API key) and whether they may now (rate limit)."""

from __future__ import annotations

from fastapi import Request

from clef_runtime.server.context import context_of
from clef_runtime.server.errors import ApiError
from clef_runtime.server.runtime import runtime_of

__all__ = ["ANONYMOUS_CALLER", "admit_caller", "authenticate"]

ANONYMOUS_CALLER = "anonymous"
"""The metrics' caller label of a request without a key (client addresses are not labels)."""


def authenticate(request: Request) -> None:
    """Raise :class:`ApiError` 401 unless the request may proceed (always passes with auth off)."""
    name = runtime_of(request).keys.check(request.headers)
    if name is not None:
        context_of(request).key = name


def admit_caller(request: Request) -> None:
    """Authenticate the request and take one request from its caller's rate limit (a decision route's
    first step). The caller is its key's name, or its client address with auth off. The ``X-RateLimit-*``
    headers go on the response, whatever its status.

    Raises :class:`ApiError` 401 (auth) or 429 ``rate_limited`` with Retry-After."""
    runtime = runtime_of(request)
    name = runtime.keys.check(request.headers)
    if name is not None:
        context_of(request).key = name  # the log line's key=NAME (the key itself is never logged)
    limiter = runtime.limiter
    if limiter is None:
        return
    address = request.client.host if request.client is not None else ""
    decision = limiter.take(name if name is not None else f"address:{address}")
    headers = decision.headers()
    # Metric labels are key names (bounded by the configuration); client addresses are not.
    label = name or ANONYMOUS_CALLER
    runtime.metrics.caller_requests.labels(label, "admitted" if decision.allowed else "rate_limited").inc()
    if not decision.allowed:
        runtime.metrics.rejected.labels("rate_limited").inc()
        context_of(request).caller = label
        raise ApiError(
            429,
            "rate_limited",
            f"over the rate limit of {limiter.describe()} for "
            f"{'key ' + repr(name) if name else 'this client address'}; retry in {headers['Retry-After']} s",
            headers=headers,
        )
    context_of(request).rate_limit_headers = headers
