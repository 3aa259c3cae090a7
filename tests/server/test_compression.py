"""Compression both ways: request bodies by Content-Encoding (zstd, gzip, deflate; corrupt or bombs refused),
responses by Accept-Encoding (zstd and gzip above a minimum size, never for streaming)."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zstandard
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from clef_runtime.server.compression import MIN_COMPRESS_BYTES, CompressionMiddleware, choose_encoding
from tests.server.conftest import Served
from tests.server.helpers import REQUEST, assert_error_shape, post

# 200 options: a response body of several KiB.
BIG = {
    "state": "s",
    "questions": {"q": {"type": "choice", "criteria": {f"option-{i}": None for i in range(200)}}},
}


def raw_response(
    client: TestClient, method: str, path: str, accept: str, body: Any = None
) -> tuple[Any, bytes]:
    """The response and its body bytes exactly as sent (httpx would otherwise decode them)."""
    with client.stream(method, path, json=body, headers={"accept-encoding": accept}) as response:
        return response, b"".join(response.iter_raw())


DECODE = {
    "zstd": lambda data: zstandard.ZstdDecompressor().stream_reader(data).read(),
    "gzip": gzip.decompress,
}


@pytest.mark.parametrize("coding", ["zstd", "gzip"])
@pytest.mark.parametrize(
    ("method", "path", "body"), [("POST", "/v1/systemone", BIG), ("GET", "/openapi.json", None)]
)
def test_large_responses_are_compressed_as_accepted(
    serve_fake: Callable[..., Served], coding: str, method: str, path: str, body: Any
) -> None:
    client = serve_fake(deterministic=True).client  # identical bodies for identical requests
    plain, plain_bytes = raw_response(client, method, path, "identity", body)
    assert "content-encoding" not in plain.headers
    assert len(plain_bytes) >= MIN_COMPRESS_BYTES
    packed, packed_bytes = raw_response(client, method, path, f"{coding}, br;q=0.5", body)
    assert packed.status_code == 200
    assert packed.headers["content-encoding"] == coding
    assert "accept-encoding" in packed.headers["vary"].lower()
    assert int(packed.headers["content-length"]) == len(packed_bytes) < len(plain_bytes)
    assert json.loads(DECODE[coding](packed_bytes)) == json.loads(plain_bytes)


def test_small_responses_and_refused_codings_are_sent_as_they_are(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake().client
    response, _ = raw_response(client, "GET", "/health", "zstd, gzip")
    assert "content-encoding" not in response.headers  # a few dozen bytes: not worth it
    response, data = raw_response(client, "POST", "/v1/systemone", "zstd;q=0, gzip;q=0", BIG)
    assert "content-encoding" not in response.headers and json.loads(data)["answers"]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("identity", None),
        ("gzip", "gzip"),
        ("gzip, zstd", "zstd"),
        ("zstd;q=0.5, gzip", "gzip"),
        ("zstd;q=0, gzip;q=0", None),
        ("*", "zstd"),
        ("*;q=0.1, gzip;q=0", "zstd"),
        ("br, deflate", None),
        ("GZIP;Q=0.8", "gzip"),
    ],
)
def test_choose_encoding_follows_q_values(header: str | None, expected: str | None) -> None:
    assert choose_encoding(header) == expected


def test_streaming_responses_are_never_compressed() -> None:
    app = FastAPI()

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield b"x" * 4096

        return StreamingResponse(chunks(), media_type="text/plain")

    app.add_middleware(CompressionMiddleware)
    with TestClient(app) as client:
        response, data = raw_response(client, "GET", "/stream", "zstd, gzip")
    assert "content-encoding" not in response.headers
    assert data == b"x" * 16384


# ------------------------------------------------------------------------------------ request bodies


def test_zstd_gzip_and_deflate_bodies_are_accepted(client: TestClient) -> None:
    raw = json.dumps({**REQUEST, "state": "refund " * 400}).encode()
    expected = post(client, raw).json()["answers"]
    encoders = {
        "zstd": zstandard.ZstdCompressor().compress,
        "gzip": gzip.compress,
        "x-gzip": gzip.compress,
        "deflate": zlib.compress,
        "identity": lambda data: data,
        "gzip, zstd": lambda data: zstandard.ZstdCompressor().compress(gzip.compress(data)),
    }
    for encoding, encode in encoders.items():
        response = post(client, encode(raw), headers={"content-encoding": encoding})
        assert response.status_code == 200, (encoding, response.text)
        assert response.json()["answers"] == expected


def test_zstd_without_a_declared_content_size_is_accepted(client: TestClient) -> None:
    raw = json.dumps(REQUEST).encode()
    compressor = zstandard.ZstdCompressor(write_content_size=False)
    streamed = compressor.compressobj().compress(raw) + compressor.compressobj().flush()
    chunker = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    streamed = chunker.compress(raw) + chunker.flush()
    assert post(client, streamed, headers={"content-encoding": "zstd"}).status_code == 200


def test_corrupt_or_unknown_encodings_are_4xx(client: TestClient) -> None:
    assert_error_shape(post(client, b"not zstd at all", headers={"content-encoding": "zstd"}), 400)
    assert_error_shape(post(client, b"\x1f\x8b garbage", headers={"content-encoding": "gzip"}), 400)
    assert_error_shape(
        post(client, gzip.compress(b'{"a":1}')[:-9], headers={"content-encoding": "gzip"}), 400
    )
    assert_error_shape(post(client, b"{}", headers={"content-encoding": "br"}), 415, "unsupported_media_type")


def test_decompression_bombs_are_413(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(max_body_bytes=64 * 1024).client
    bomb = b'{"state": "' + b" " * (10 * 1024 * 1024) + b'"}'
    for encoding, data in (
        ("zstd", zstandard.ZstdCompressor().compress(bomb)),
        ("gzip", gzip.compress(bomb)),
    ):
        assert len(data) < 64 * 1024
        response = post(client, data, headers={"content-encoding": encoding})
        assert_error_shape(response, 413, "request_too_large")
    assert post(client, REQUEST).status_code == 200
