"""API-key authentication.

With no key configured, auth is off and any ``Authorization`` header is ignored (the official SDKs always
send one). With keys configured, a key is read from ``Authorization: Bearer <key>`` (TypeSafe's
convention) or ``X-API-Key: <key>`` (SystemOne Builder's), and compared in constant time against every
configured key, so neither the position of a mismatch nor which key matched shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers

from clef_runtime.server.errors import ApiError

__all__ = ["KeyChecker"]


def _digest(key: bytes) -> bytes:
    # Comparing fixed-length digests keeps the comparison constant-time even for keys of different lengths
    # (compare_digest leaks length differences) and works for non-ASCII keys.
    return hashlib.sha256(key).digest()


class KeyChecker:
    """Checks the API key of a request against the configured keys."""

    def __init__(self, keys: Sequence[str]) -> None:
        # Configured keys are text (UTF-8 on the wire); header values arrive as latin-1-decoded bytes.
        self._digests = tuple(_digest(key.encode("utf-8")) for key in keys)

    @property
    def enabled(self) -> bool:
        """True when keys are configured."""
        return bool(self._digests)

    @staticmethod
    def presented_key(headers: Headers) -> str | None:
        """The key a request carries: ``Authorization: Bearer`` first, then ``X-API-Key``; None if neither."""
        authorization = headers.get("authorization")
        if authorization:
            scheme, _, credentials = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and credentials.strip():
                return credentials.strip()
        api_key = headers.get("x-api-key")
        if api_key and api_key.strip():
            return api_key.strip()
        return None

    def matches(self, key: str) -> bool:
        """True when ``key`` (a header value as Starlette decodes it, latin-1) equals one of the configured
        keys, compared in constant time over all of them."""
        try:
            raw = key.encode("latin-1")
        except UnicodeEncodeError:  # not from a header: a Python caller passed real text
            raw = key.encode("utf-8")
        candidate = _digest(raw)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        return matched

    def check(self, headers: Headers) -> None:
        """Return if the request may proceed. Raises :class:`ApiError` 401 ``authentication_error`` when
        auth is on and the key is missing or wrong."""
        if not self._digests:
            return
        key = self.presented_key(headers)
        challenge = {"WWW-Authenticate": 'Bearer realm="clef"'}
        if key is None:
            raise ApiError(
                401,
                "authentication_error",
                "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                headers=challenge,
            )
        if not self.matches(key):
            raise ApiError(401, "authentication_error", "invalid API key", headers=challenge)
