"""Request bodies: size limits, ``Content-Encoding`` (zstd, gzip, deflate) and strict JSON.

The limit applies twice: to the bytes on the wire (checked against ``Content-Length`` before reading and
while streaming) and to the decompressed bytes (so a small zstd bomb cannot expand into memory).

``curl -d '{...}'`` labels its body ``application/x-www-form-urlencoded`` unless told otherwise: a body of
that type that parses as JSON is taken as the JSON it is; one that does not gets a 415 saying which header
to send. Multipart bodies (file uploads) are always 415.
"""

from __future__ import annotations

import io
import json
import logging
import zlib
from typing import Any

import anyio
import zstandard
from starlette.requests import ClientDisconnect, Request

from clef_runtime.server.context import context_of
from clef_runtime.server.errors import ApiError, ClientGone
from clef_runtime.server.runtime import runtime_of
from clef_runtime.server.tracing import phase

__all__ = [
    "check_content_type",
    "decode_content",
    "parse_json",
    "read_body",
    "read_json_body",
]

logger = logging.getLogger("clef_runtime.server")

_FORM_TYPE = "application/x-www-form-urlencoded"
_JSON_HINT = "send the JSON with -H 'Content-Type: application/json'"


def _too_large(limit: int, what: str) -> ApiError:
    """413 for a body over ``limit``; ``what`` says how large it is ("is 5000 bytes (Content-Length)")."""
    return ApiError(
        413,
        "request_too_large",
        f"the request body {what}, over the limit of {limit} bytes (--max-body-bytes)",
        extra={"limit": limit},
    )


async def read_body(request: Request, limit: int) -> bytes:
    """Read the raw (possibly compressed) body, refusing more than ``limit`` bytes.

    Returns the bytes. Raises :class:`ApiError` 413 when the declared or actual length is over the limit,
    400 for a malformed ``Content-Length``, and :class:`ClientGone` when the client disconnects.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise ApiError(400, "invalid_request_error", f"malformed Content-Length header: {declared!r}")
        if int(declared) > limit:
            raise _too_large(limit, f"is {int(declared)} bytes (Content-Length)")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                # A chunked body has no declared length: say how far the read got before it stopped.
                raise _too_large(
                    limit, f"reached {size} bytes when reading stopped (sent without Content-Length)"
                )
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _decode_one(data: bytes, encoding: str, limit: int) -> bytes:
    if encoding == "zstd":
        try:
            # stream_reader does not need the frame to declare its content size, and read(limit + 1)
            # stops expanding a bomb as soon as it is over the limit.
            with zstandard.ZstdDecompressor().stream_reader(
                io.BytesIO(data), read_across_frames=True
            ) as reader:
                out = reader.read(limit + 1)
        except zstandard.ZstdError as exc:
            raise ApiError(
                400, "invalid_request_error", f"the zstd body cannot be decompressed: {exc}"
            ) from None
    elif encoding in ("gzip", "x-gzip", "deflate"):
        # gzip: wbits 16+MAX; deflate is zlib-wrapped per RFC 9110 (raw deflate tried as a fallback).
        candidates = [16 + zlib.MAX_WBITS] if encoding != "deflate" else [zlib.MAX_WBITS, -zlib.MAX_WBITS]
        out = b""
        for wbits in candidates:
            try:
                decompressor = zlib.decompressobj(wbits)
                out = decompressor.decompress(data, limit + 1)
                if len(out) <= limit and not decompressor.eof:
                    raise zlib.error("truncated stream")
                break
            except zlib.error as exc:
                if wbits == candidates[-1]:
                    raise ApiError(
                        400, "invalid_request_error", f"the {encoding} body cannot be decompressed: {exc}"
                    ) from None
    else:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"unsupported Content-Encoding {encoding!r}; use zstd, gzip, deflate or none",
        )
    if len(out) > limit:
        raise _too_large(limit, f"decompresses to at least {len(out)} bytes")
    return out


def decode_content(data: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (a comma-separated list, applied in order, so undone in reverse).

    Returns the decoded bytes. Raises :class:`ApiError` 415 for an unknown coding, 400 for corrupt data
    and 413 when the decoded body exceeds ``limit``.
    """
    if not content_encoding:
        return data
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        data = _decode_one(data, coding, limit)
    return data


def _media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def check_content_type(content_type: str | None) -> None:
    """Refuse, before the body is read, a type no JSON route accepts: multipart (file uploads).

    Raises :class:`ApiError` 415. A missing type, JSON and a form type pass (see `parse_json`)."""
    media_type = _media_type(content_type)
    if media_type.startswith("multipart/"):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type {media_type!r} is not supported: images and files go inside the JSON body "
            f"(data: URLs), not as multipart parts; {_JSON_HINT}",
        )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes, content_type: str | None = None) -> Any:
    """Parse a body as strict JSON (UTF-8, no NaN/Infinity).

    Returns the value. Raises :class:`ApiError` 422 with FastAPI's ``json_invalid`` shape on any problem; for
    a body sent as ``application/x-www-form-urlencoded`` (curl's ``-d`` without a Content-Type) that is not
    JSON, 415 naming the header to send instead.
    """
    if _media_type(content_type) == _FORM_TYPE:
        try:
            return parse_json(data)
        except ApiError:
            raise ApiError(
                415,
                "unsupported_media_type",
                f"the body is sent as {_FORM_TYPE} (curl -d does that) and is not JSON; form fields are not "
                f"supported: {_JSON_HINT}",
            ) from None

    def invalid(position: int | None, reason: str) -> ApiError:
        loc: tuple[Any, ...] = ("body",) if position is None else ("body", position)
        return ApiError(
            422,
            "invalid_request_error",
            f"JSON decode error: {reason}",
            validation=[{"loc": loc, "msg": f"JSON decode error: {reason}", "type": "json_invalid"}],
        )

    if not data.strip():
        raise invalid(None, "the request body is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(exc.start, "the body is not UTF-8") from None
    if text.startswith("\ufeff"):
        text = text[1:]  # a BOM is tolerated, as many HTTP clients on Windows send one
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise invalid(exc.pos, exc.msg) from None
    except ValueError as exc:
        raise invalid(None, str(exc)) from None
    except RecursionError:
        raise invalid(None, "the JSON is nested too deeply") from None


async def read_json_body(request: Request) -> Any:
    """Read, decompress and parse the JSON body within the configured limits.

    Returns the decoded JSON value. Raises :class:`ApiError` (400/413/415/422) or
    :class:`ClientGone` when the client disconnects mid-body.
    """
    runtime = runtime_of(request)
    limit = runtime.settings.max_body_bytes
    content_type = request.headers.get("content-type")
    check_content_type(content_type)
    with phase(request, "clef.read_body"):
        raw = await read_body(request, limit)
    encoding = request.headers.get("content-encoding")

    def decode() -> Any:
        return parse_json(decode_content(raw, encoding, limit), content_type)

    # Decompression and parsing of a multi-megabyte body take milliseconds: keep them off the event loop.
    data = await anyio.to_thread.run_sync(decode)
    if runtime.settings.log_requests:
        logger.info(
            "request_id=%s request_body=%s",
            context_of(request).request_id,
            json.dumps(data, ensure_ascii=False, separators=(",", ":")),
        )
    return data
