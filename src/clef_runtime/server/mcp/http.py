"""``POST /mcp``: the ``decide`` tool (`clef_runtime.server.mcp.tool`) and the caller's saved classifiers
(`clef_runtime.server.mcp.classifiers`) over MCP's Streamable HTTP transport, stateless, with JSON responses
(no SSE stream, no session: any replica can answer any POST).

Every request is authenticated before the SDK sees it (401 like every route with ``--api-key``); a
``tools/call`` of ``decide`` then runs the server's one decision flow (`clef_runtime.server.flow`) with the
tool's arguments as the System One body, so it is rate-limited (one request of the caller's
``--rate-limit`` per call; ``initialize`` and ``tools/list`` are not charged), batched, cached, measured and
timed like ``POST /v1/systemone``, and answers the same body (a ``classify_<name>`` call: like ``POST
/v1/classifiers/{name}/decide``). The transport: the MCP specification's
"Streamable HTTP" (https://modelcontextprotocol.io/specification/2025-06-18/basic/transports), served by the
official SDK's session manager.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, ExitStack, asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import mcp_types as types
from fastapi import APIRouter, FastAPI
from mcp.server import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from clef_runtime.protocol.errors import ClefError
from clef_runtime.server.admission import authenticate
from clef_runtime.server.bodies import read_body
from clef_runtime.server.context import context_of
from clef_runtime.server.cors import origin_allowed
from clef_runtime.server.errors import ApiError, ClientGone
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import SYSTEMONE, WireMapping, answer_decision
from clef_runtime.server.mcp.classifiers import ClassifierTools
from clef_runtime.server.mcp.tool import malformed_message_error, mcp_server
from clef_runtime.server.settings import ServerSettings

__all__ = ["FEATURE", "MCP_PATH", "McpEndpoint"]

MCP_PATH = "/mcp"

logger = logging.getLogger("clef_runtime.server")


def _check_origin(request: Request) -> None:
    """Refuse a browser's cross-origin call: the transport's specification requires servers to validate
    ``Origin`` against DNS rebinding (a page on another site reaching a server on the user's loopback).
    Clients that are not browsers send no ``Origin``; a page served by this server has its own origin; the
    origins of ``--cors-origin`` are trusted by the operator.

    Raises `ApiError` 403 when ``Origin`` names another host than the request's ``Host``."""
    origin = request.headers.get("origin")
    if origin is None or origin_allowed(origin, request.app.state.settings.cors_origins):
        return
    origin_host = urlsplit(origin).netloc.lower()
    if not origin_host or origin_host != request.headers.get("host", "").lower():
        raise ApiError(
            403,
            "forbidden_origin",
            f"Origin {origin!r} is not this server ({request.headers.get('host', '')!r}): MCP over HTTP "
            "refuses cross-origin browser calls (DNS rebinding protection)",
        )


async def _answer_in_the_flow(
    mapping: WireMapping[Any], arguments: dict[str, Any], ctx: ServerRequestContext[Any, Any]
) -> dict[str, Any]:
    """Answer a tool call through `answer_decision` with the route mapping ``mapping``, on the HTTP request
    that carried it (the SDK hands it over in the tool's context): auth, the caller's rate limit, readiness,
    validation, the engine, metrics and the ``x_`` extras are that route's. Raises `ApiError` for a refused
    call."""
    request = ctx.request
    if not isinstance(request, Request):
        raise TypeError(f"an MCP call over HTTP carries its Starlette request, got {type(request).__name__}")
    try:
        response = await answer_decision(request, mapping, data=arguments)
    except (ApiError, ClefError):
        raise
    except Exception:
        # What the other routes answer with a 500 (the middleware's), here as the call's tool error.
        request_id = context_of(request).request_id
        logger.exception("request_id=%s internal error", request_id)
        context_of(request).error_type = "internal_error"
        raise ApiError(
            500, "internal_error", f"internal server error; quote request id {request_id} when reporting it"
        ) from None
    if response.status_code != 200:
        # The flow's only non-error answer besides 200: the client went away (499, never delivered).
        raise ApiError(response.status_code, "client_closed_request", "the client closed the connection")
    answer: dict[str, Any] = json.loads(bytes(response.body))
    return answer


async def _decide_in_the_flow(
    arguments: dict[str, Any], ctx: ServerRequestContext[Any, Any]
) -> dict[str, Any]:
    """Answer a ``decide`` call as ``POST /v1/systemone`` answers its body."""
    return await _answer_in_the_flow(SYSTEMONE, arguments, ctx)


def _json_rpc_error(status: int, error: types.ErrorData) -> JSONResponse:
    """An HTTP error whose body is a JSON-RPC error (id null: the message's id was not read), as MCP clients
    expect from ``POST /mcp`` rather than the other routes' ``{"detail": ...}``."""
    reply = {"jsonrpc": "2.0", "id": None, "error": error.model_dump(mode="json", exclude_none=True)}
    return JSONResponse(reply, status_code=status)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the SDK's transport after the body was read here: the body first, then what the
    client sends next (its disconnect)."""
    pending = [body]

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replay


async def _checked_body(request: Request, limit: int) -> bytes | JSONResponse:
    """The body when it is one JSON-RPC message of at most ``limit`` bytes, else the JSON-RPC error to answer:
    413 for a body too large, 400 for one that is not JSON (-32700) or not a JSON-RPC message (-32600, or
    -32602 for ``params``), in a short message naming the field (`malformed_message_error`). The SDK's
    transport answers the same bodies with a plain-text 413 and pydantic's report on every message kind."""
    try:
        body = await read_body(request, limit)
    except ApiError as exc:  # over the limit, or a malformed Content-Length
        context_of(request).error_type = exc.error_type
        return _json_rpc_error(exc.status, types.ErrorData(code=types.INVALID_REQUEST, message=exc.message))
    try:
        types.jsonrpc_message_adapter.validate_json(body, by_name=False)
    except ValidationError as exc:
        error = malformed_message_error(exc)
        context_of(request).error_type = "invalid_request_error"
        return _json_rpc_error(400, error)
    return body


class McpEndpoint:
    """The ASGI endpoint of ``POST /mcp``: authentication, then the SDK's stateless Streamable HTTP
    transport in JSON-response mode. `running` must be entered for the app's lifespan (the transport runs
    each call in a task group of its own)."""

    def __init__(self, settings: ServerSettings) -> None:
        # decide, and the caller's saved classifiers as classify_<name> (mcp_classifiers).
        self._server = mcp_server(_decide_in_the_flow, ClassifierTools(_answer_in_the_flow))
        self._max_body_bytes = settings.max_body_bytes
        self._manager: StreamableHTTPSessionManager | None = None

    def route(self) -> Route:
        """The ``POST /mcp`` route (not in the OpenAPI schema: its body is JSON-RPC, described by MCP).
        Other methods get 405: a stateless server offers no GET stream and has no session to DELETE."""
        return Route(MCP_PATH, endpoint=self, methods=["POST"], include_in_schema=False)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the transport for the app's lifespan. A session manager runs once, so each lifespan (a test
        may start an app twice) gets a new one."""
        manager = StreamableHTTPSessionManager(
            app=self._server,
            json_response=True,
            stateless=True,
            max_request_body_size=self._max_body_bytes,
        )
        async with manager.run():
            self._manager = manager
            try:
                yield
            finally:
                self._manager = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            _check_origin(request)
            # Before any MCP processing: a caller without a valid key learns nothing, not even the tool list.
            authenticate(request)
        except ApiError as error:
            context_of(request).error_type = error.error_type
            await error.response()(scope, receive, send)
            return
        manager = self._manager
        if manager is None:
            not_ready = ApiError(
                503, "not_ready", "the server is starting or shutting down", headers={"Retry-After": "2"}
            )
            await not_ready.response()(scope, receive, send)
            return
        try:
            checked = await _checked_body(request, self._max_body_bytes)
        except ClientGone:
            return  # nobody to answer
        if isinstance(checked, JSONResponse):
            await checked(scope, receive, send)
            return
        await manager.handle_request(scope, _replaying(checked, receive), send)


def _attach_mcp(app: FastAPI, resources: ExitStack) -> AbstractAsyncContextManager[None]:
    """``POST /mcp``: the decide tool over MCP, through the same decision flow; its transport runs while the
    server serves."""
    mcp = McpEndpoint(app.state.settings)
    app.router.routes.append(mcp.route())
    return mcp.running()


DESCRIPTION = """\
**MCP** (`POST /mcp`, not listed below): the Model Context Protocol's Streamable HTTP transport, so that an
agent can use the model as a tool: `decide` takes a System One request, and each saved classifier is a tool
`classify_<name>`. The same keys and rate limits apply. More: the README's "MCP" (`clef mcp` serves `decide`
over stdio, for desktop agents).
"""

FEATURE = Feature("mcp", APIRouter(), attach=_attach_mcp, description=DESCRIPTION)
"""``POST /mcp`` (not in the OpenAPI schema: its body is JSON-RPC, described by MCP)."""
