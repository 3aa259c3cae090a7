"""Response compression by ``Accept-Encoding``: zstd or gzip, for complete bodies of at least a minimum size.

A pure ASGI middleware. A response is compressed only when it arrives in one body message (so streaming
responses pass through untouched), is at least ``minimum_size`` bytes, has no ``Content-Encoding`` yet and
the client accepts one of our codings with ``q > 0``. zstd wins a tie: it is faster at a better ratio.
"""

from __future__ import annotations

import gzip
from typing import Final

import zstandard
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clef_runtime.server.asgi import HttpMiddleware

__all__ = ["MIN_COMPRESS_BYTES", "CompressionMiddleware", "choose_encoding"]

MIN_COMPRESS_BYTES: Final = 1024
"""Smaller bodies are sent as they are: the framing would eat most of the saving."""

_PREFERENCE: Final = ("zstd", "gzip")
_ZSTD_LEVEL: Final = 3
_GZIP_LEVEL: Final = 5


def choose_encoding(accept_encoding: str | None) -> str | None:
    """The coding to answer with, given an ``Accept-Encoding`` header: ``"zstd"``, ``"gzip"`` or None.

    The highest ``q`` wins (zstd at a tie); ``*`` stands for any coding not named; ``q=0`` refuses one.
    """
    if not accept_encoding:
        return None
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        name = name.strip().lower()
        if not name:
            continue
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        weights[name] = q
    wildcard = weights.get("*", 0.0)
    best, best_q = None, 0.0
    for coding in _PREFERENCE:
        q = weights.get(coding, wildcard)
        if q > best_q:
            best, best_q = coding, q
    return best


def _compress(body: bytes, coding: str) -> bytes:
    if coding == "zstd":
        return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(body)
    return gzip.compress(body, compresslevel=_GZIP_LEVEL, mtime=0)


class CompressionMiddleware(HttpMiddleware):
    """Compress complete response bodies of at least ``minimum_size`` bytes by the request's
    ``Accept-Encoding`` (zstd or gzip)."""

    def __init__(self, app: ASGIApp, minimum_size: int = MIN_COMPRESS_BYTES) -> None:
        super().__init__(app)
        self.minimum_size = minimum_size

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        coding = choose_encoding(Headers(scope=scope).get("accept-encoding"))
        if coding is None:
            await self.app(scope, receive, send)
            return
        start: list[Message] = []
        passing_through = False

        async def compressing_send(message: Message) -> None:
            nonlocal passing_through
            if passing_through:
                await send(message)
                return
            if message["type"] == "http.response.start":
                start.append(message)  # held until the first body message says whether it is all
                return
            if message["type"] != "http.response.body" or not start:
                await send(message)
                return
            head = start.pop()
            passing_through = True
            body: bytes = message.get("body", b"")
            headers = MutableHeaders(scope=head)
            if (
                message.get("more_body", False)  # streaming: never buffered or compressed
                or len(body) < self.minimum_size
                or "content-encoding" in headers
            ):
                await send(head)
                await send(message)
                return
            compressed = _compress(body, coding)
            headers["content-encoding"] = coding
            headers["content-length"] = str(len(compressed))
            headers.add_vary_header("Accept-Encoding")
            await send(head)
            await send({"type": "http.response.body", "body": compressed, "more_body": False})

        await self.app(scope, receive, compressing_send)
