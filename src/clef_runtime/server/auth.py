"""API-key authentication.

With no key configured, auth is off and any ``Authorization`` header is ignored (the official SDKs always
send one). With keys configured, a key is read from ``Authorization: Bearer <key>`` (TypeSafe's
convention) or ``X-API-Key: <key>`` (SystemOne Builder's), and compared in constant time against every
configured key, so neither the position of a mismatch nor which key matched shows in the timing.

Keys have names, which is what rate limits, metrics, and request log lines (``key=NAME``) use, never the key
itself: a configured value ``NAME:KEY`` (``NAME`` of letters, digits, ``_``, ``.``, ``-``; at most 64;
``KEY`` non-empty) names its key; a value without a colon is a key named by its position, ``key-1``,
``key-2``, ... A value with a colon is always read as ``NAME:KEY`` (a key that contains a colon itself needs
a name), so a mistyped name is refused rather than silently becoming part of a bare key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.datastructures import Headers

from clef_runtime.server.errors import ApiError

__all__ = ["KeyChecker", "NamedKey", "parse_key"]

_KEY_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _digest(key: bytes) -> bytes:
    # Comparing fixed-length digests keeps the comparison constant-time even for keys of different lengths
    # (compare_digest leaks length differences) and works for non-ASCII keys.
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class NamedKey:
    """A configured key and the name it is known by."""

    name: str
    secret: str = ""


def parse_key(value: str, position: int) -> NamedKey:
    """A configured ``--api-key`` value: ``NAME:KEY``, or a bare key (no colon) named ``key-<position>``
    (1-based). Raises ValueError, without the key in its message, for a value with a colon whose name is
    not a valid name or whose key is empty."""
    name, colon, secret = value.partition(":")
    if not colon:
        return NamedKey(f"key-{position}", value)
    if not _KEY_NAME.match(name):
        # The value may be a real key: quote the name part only, never what follows the colon.
        raise ValueError(
            f"--api-key value {position}: a value with a colon is NAME:KEY, and the name {name!r} is not one "
            "(1-64 letters, digits, '_', '.', '-'; a key that contains a colon needs a name)"
        )
    if not secret:
        raise ValueError(f"--api-key {name}: the key after 'NAME:' is empty (NAME:KEY)")
    return NamedKey(name, secret)


class KeyChecker:
    """Checks the API key of a request against the configured keys."""

    def __init__(self, keys: Sequence[str]) -> None:
        named = [parse_key(value, position) for position, value in enumerate(keys, 1)]
        self.names = tuple(key.name for key in named)
        """The keys' names, in the configured order."""
        # Configured keys are text (UTF-8 on the wire); header values arrive as latin-1-decoded bytes.
        self._digests = tuple(_digest(key.secret.encode("utf-8")) for key in named)

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
        return self.name_of(key) is not None

    def name_of(self, key: str) -> str | None:
        """The name of the configured key equal to ``key`` (None: no match), compared in constant time over
        all of them."""
        try:
            raw = key.encode("latin-1")
        except UnicodeEncodeError:  # not from a header: a Python caller passed real text
            raw = key.encode("utf-8")
        candidate = _digest(raw)
        matched = -1
        for index, digest in enumerate(self._digests):
            equal = hmac.compare_digest(candidate, digest)
            matched = index if equal else matched
        return None if matched < 0 else self.names[matched]

    def check(self, headers: Headers) -> str | None:
        """The name of the request's key (None with auth off) if it may proceed. Raises :class:`ApiError`
        401 ``authentication_error`` when auth is on and the key is missing or wrong."""
        if not self._digests:
            return None
        key = self.presented_key(headers)
        challenge = {"WWW-Authenticate": 'Bearer realm="clef"'}
        if key is None:
            raise ApiError(
                401,
                "authentication_error",
                "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
                headers=challenge,
            )
        name = self.name_of(key)
        if name is None:
            raise ApiError(401, "authentication_error", "invalid API key", headers=challenge)
        return name
