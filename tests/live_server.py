"""A live loopback server around a real engine (uvicorn in a thread), for the tests that drive a client
library against it: tests/server/openai/test_openai_client.py and the client suites in tests/clients/.

The server records every HTTP exchange (request body, status, response body) in ``Live.exchanges``, so a
test can see exactly what a library sent and what it got back, and compare the decision with the equivalent
``/v1/systemone`` request (:func:`systemone`).
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
import zstandard

from clef_runtime.engine.clef import Clef
from clef_runtime.server.settings import ServerSettings
from tests.server.conftest import build_app
from tests.serving import free_port


@dataclass
class Exchange:
    """One HTTP request the live server answered, as it crossed the wire."""

    method: str
    path: str
    request: bytes
    status: int = 0
    response: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    """The response headers (lower-case names)."""
    request_headers: dict[str, str] = field(default_factory=dict)

    @property
    def request_text(self) -> str:
        """The request body, decoded by its ``Content-Encoding``."""
        return _decoded(self.request, self.request_headers.get("content-encoding")).decode(errors="replace")

    @property
    def response_text(self) -> str:
        """The response body, decoded by its ``Content-Encoding`` (the server compresses large ones)."""
        return _decoded(self.response, self.headers.get("content-encoding")).decode(errors="replace")

    def json(self) -> Any:
        """The request body as JSON."""
        return json.loads(self.request_text)

    def reply(self) -> Any:
        """The response body as JSON (not for a stream: see :meth:`events`)."""
        return json.loads(self.response_text)

    def events(self) -> list[Any]:
        """The ``data:`` payloads of a server-sent event stream, JSON-decoded, ``[DONE]`` left out."""
        payloads = []
        for line in self.response_text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payloads.append(json.loads(line[len("data: ") :]))
        return payloads

    def describe(self) -> str:
        """The exchange as text, for an assertion message or a defect report."""
        return (
            f"{self.method} {self.path}\nrequest: {self.request_text}\n"
            f"-> {self.status}: {self.response_text[:4000]}"
        )


def _decoded(body: bytes, coding: str | None) -> bytes:
    if coding == "gzip":
        return gzip.decompress(body)
    if coding == "zstd":
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    return body


class _Recorder:
    """ASGI middleware that keeps every HTTP exchange (bodies in full) in ``exchanges``."""

    def __init__(self, app: Any, exchanges: list[Exchange]) -> None:
        self.app = app
        self.exchanges = exchanges

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(scope["method"], scope["path"], b"")
        exchange.request_headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        self.exchanges.append(exchange)

        async def recording_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                exchange.request += message.get("body", b"")
            return message

        async def recording_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                exchange.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                exchange.response += message.get("body", b"")
            await send(message)

        await self.app(scope, recording_receive, recording_send)


class Live:
    """``build_app`` around ``engine``, served by uvicorn on a free loopback port in a daemon thread.

    ``settings`` override the ServerSettings (``api_keys=("test-key",)`` turns auth on; ``key`` is then the
    key :func:`systemone` sends)."""

    def __init__(self, engine: Clef, key: str = "test-key", **settings: Any) -> None:
        port = free_port()
        # Several run at once, and a jobs database has one owner: these need no jobs.
        self.app = build_app(
            ServerSettings(**{"model": "tiny", "port": port, "jobs": False, **settings}), engine
        )
        self.key = key
        self.exchanges: list[Exchange] = []
        self.server = uvicorn.Server(
            uvicorn.Config(
                _Recorder(self.app, self.exchanges),
                host="127.0.0.1",
                port=port,
                log_config=None,
                access_log=False,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server.started and self.app.state.runtime.state == "ready"):
            assert time.monotonic() < deadline, "live server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"

    def calls(self, path: str, since: int = 0) -> list[Exchange]:
        """The exchanges with ``path`` from index ``since`` of ``exchanges`` on, in order."""
        return [e for e in self.exchanges[since:] if e.path == path]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def systemone(live: Live, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to the live server's ``/v1/systemone`` and return the 200 response."""
    response = httpx.post(live.url + "/v1/systemone", json=body, headers={"x-api-key": live.key}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def first_max(probabilities: dict[str, float]) -> str:
    """The first most probable key (the server's tie rule)."""
    return max(probabilities, key=probabilities.__getitem__)
