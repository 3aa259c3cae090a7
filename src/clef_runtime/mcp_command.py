"""``clef mcp``: the ``decide`` tool (`clef_runtime.server.mcp.tool`) over MCP's stdio transport, for desktop
agents that launch a local server as a subprocess, with the model loaded in this process.

The transport (https://modelcontextprotocol.io/specification/2025-06-18/basic/transports#stdio): JSON-RPC
messages on stdin and stdout, one per line; stdout carries nothing else, so logs go to stderr (and while it
serves, the SDK points file descriptor 1 at stderr, so even a stray ``print`` misses the wire).

The server answers ``initialize`` and ``tools/list`` at once while the model loads (a real release takes a
while, and agents time out a silent server); a ``decide`` call waits for the load. The model runs on one
thread of its own, which loads it and computes every call in turn: one CPU thread team, as ``clef serve``'s
engine thread (see `clef_runtime.model.kernels.configure_cpu_threads`). A model that cannot be loaded ends
the process with status 1, after its reason on stderr.

It decides with the `Clef` facade itself, as ``clef decide`` does, not through the HTTP server's engine
contract: only a model loaded in this process ever runs here (no Ray ingress, no test engine).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
from collections.abc import AsyncIterable, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import mcp_types as types
from mcp.server import ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from clef_runtime.logs import configure_logging
from clef_runtime.server.errors import ApiError
from clef_runtime.server.mcp.tool import malformed_message_error, mcp_server

if TYPE_CHECKING:
    from clef_runtime.engine.clef import Clef

__all__ = ["serve_stdio"]

logger = logging.getLogger("clef_runtime.server")

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILURE = 1


class _MessageSender(Protocol):
    """The transport's write stream, as far as it is used here."""

    async def send(self, item: SessionMessage, /) -> None: ...


class _EngineThread:
    """One daemon thread that runs submitted calls in order (the model's only compute thread). A daemon,
    unlike a `ThreadPoolExecutor` worker, so that a client closing stdin while the model still loads ends
    the process at once instead of after the load."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="clef-mcp-engine", daemon=True).start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        """Queue ``call``; its future has its result or its exception."""
        future: Future[T] = Future()
        self._calls.put((call, future))
        return future

    def _run(self) -> None:
        while True:
            call, future = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # delivered to the caller, who decides what it means
                future.set_exception(exc)


def _load_here(load: Callable[[], Clef | None]) -> Clef | None:
    """Load the model on the calling thread (the engine thread) and start its CPU thread team there."""
    clef = load()
    if clef is not None:
        clef.prepare_compute_thread()
    return clef


def _exit_for_a_failed_load() -> None:
    """End the process with status 1 now, its reason already on stderr. Returning instead would wait for the
    client to close stdin: the transport reads it on a thread that no cancellation interrupts, and an agent
    waits for the server rather than closing it."""
    logging.shutdown()  # flush every log handler
    sys.stderr.flush()
    os._exit(EXIT_FAILURE)


async def _answer_malformed_lines(
    incoming: AsyncIterable[SessionMessage | Exception],
    outgoing: _MessageSender,
    messages: anyio.abc.ObjectSendStream[SessionMessage | Exception],
) -> None:
    """Pass the transport's messages on to ``messages``, and answer each line that is not a JSON-RPC message
    (the SDK hands its validation error instead, and its server drops it in silence) with a JSON-RPC error,
    id null (`malformed_message_error`), so the client learns what was wrong; the next line is served."""
    async with messages:
        async for item in incoming:
            if isinstance(item, ValidationError):
                error = malformed_message_error(item)
                logger.warning("refused a stdin line that is not a JSON-RPC message: %s", error.message)
                reply = types.JSONRPCError(jsonrpc="2.0", id=None, error=error)
                await outgoing.send(SessionMessage(reply))
            else:
                await messages.send(item)


async def _serve(load: Callable[[], Clef | None]) -> None:
    engine_thread = _EngineThread()
    loading = engine_thread.submit(lambda: _load_here(load))

    async def decide(arguments: dict[str, Any], ctx: ServerRequestContext[Any, Any]) -> dict[str, Any]:
        # The first calls wait for the load; the model then answers each call on its thread, as `clef decide`.
        clef = await asyncio.wrap_future(loading)
        if clef is None:
            raise ApiError(503, "not_ready", "the model failed to load; the server is stopping")
        answer: dict[str, Any] = await asyncio.wrap_future(
            engine_thread.submit(lambda: clef.decide(arguments))
        )
        return answer

    server = mcp_server(decide)
    async with stdio_server() as (read_stream, write_stream), anyio.create_task_group() as tasks:

        async def exit_unless_loaded() -> None:
            try:
                clef = await asyncio.wrap_future(loading)
            except Exception:
                logger.exception("the model failed to load")
                clef = None
            if clef is None:  # the loader said why on stderr
                _exit_for_a_failed_load()
            logger.info("model ready; serving the decide tool on stdio")

        tasks.start_soon(exit_unless_loaded)
        messages_in, messages = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        tasks.start_soon(_answer_malformed_lines, read_stream, write_stream, messages_in)
        await server.run(messages, write_stream, server.create_initialization_options())
        # stdin closed: the client is done (a load still running ends with the process: a daemon thread).
        tasks.cancel_scope.cancel()


def serve_stdio(load: Callable[[], Clef | None]) -> int:
    """Serve ``decide`` on stdin/stdout until the client closes stdin, then return 0. ``load()`` returns the
    model, or None after saying on stderr why it cannot (it runs on the model's own thread); then the process
    ends at once with status 1 (the command's only job failed, as ``clef serve``'s does)."""
    configure_logging("info")
    anyio.run(_serve, load)
    return EXIT_OK
