"""``clef serve``: its flags, logging, the port, and running uvicorn with a graceful SIGTERM (or, with
``--ray``, handing over to ``clef_runtime.scale.ray_serve``).

``clef_runtime.cli`` wires the subcommand with :func:`add_serve_arguments` and :func:`run_serve`; tests and
benchmarks run a server in their own process with :func:`serve`. The flags come from three tables: the
engine's (`clef_runtime.options`), the server's (`clef_runtime.server.settings`) and the scale-out ones
(`clef_runtime.scale.settings`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from clef_runtime.logs import configure_logging
from clef_runtime.options import ENGINE_OPTIONS, MODEL_OPTION, Option, OptionsError, add_option_arguments
from clef_runtime.scale.settings import RAY_OPTIONS, RaySettings
from clef_runtime.server.settings import (
    OPTIONS,
    ServerSettings,
    SettingsError,
    is_loopback,
    settings_from_namespace,
)
from clef_runtime.server.tls import check_tls_files

if TYPE_CHECKING:
    from clef_runtime.server.runtime import EngineFactory

__all__ = [
    "ALL_SERVE_OPTIONS",
    "EXIT_CANNOT_LISTEN",
    "CannotListenError",
    "add_serve_arguments",
    "configure_logging",
    "listen",
    "run_serve",
    "serve",
]

logger = logging.getLogger("clef_runtime.server")

#: Every flag of ``clef serve``: the model, the engine's options, the server's own, then the scale-out ones.
ALL_SERVE_OPTIONS: tuple[Option, ...] = (MODEL_OPTION, *ENGINE_OPTIONS, *OPTIONS, *RAY_OPTIONS)

EXIT_CANNOT_LISTEN = 1
"""The exit status when the address cannot be bound (in use, not this machine's, a privileged port): the
settings are valid (that would be 2), the machine refuses them."""

_BACKLOG = 2048
"""Pending connections the kernel queues before uvicorn accepts them (uvicorn's own default)."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``clef serve`` flag to ``parser``. Each flag defaults to its ``CLEF_*`` variable, then to
    the built-in default (resolved in :func:`run_serve`, so ``--help`` shows the variable names)."""
    add_option_arguments(parser, ALL_SERVE_OPTIONS)


class CannotListenError(Exception):
    """The server's address cannot be bound; the message names it and says what to do."""


def listen(host: str, port: int, backlog: int = _BACKLOG) -> socket.socket:
    """A socket bound to ``host:port`` (IPv6 for a host with a colon) and listening, for uvicorn to serve
    on. Raises :class:`CannotListenError`."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # Listening now, not when uvicorn starts: on Linux two sockets with SO_REUSEADDR may both bind one
        # address as long as neither listens, so a second server started at the same time would pass the
        # bind and fail only inside uvicorn, after its model began to load.
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            message = f"{address} is already in use (another server?): stop it, or choose another --port"
        else:
            message = f"cannot listen on {address}: {exc.strerror or exc} (check --host and --port)"
        raise CannotListenError(message) from None
    sock.set_inheritable(True)
    return sock


def serve(
    settings: ServerSettings,
    *,
    engine_factory: EngineFactory | None = None,
    sock: socket.socket | None = None,
) -> int:
    """Run the server until SIGTERM/SIGINT, then finish accepted requests and return.

    Returns 0 after a graceful stop, 1 if the address cannot be bound (one line on stderr says why) or the
    model failed to load. ``engine_factory`` (tests, embedding) replaces ``Clef.load``; ``sock``: the
    socket :func:`listen` bound to the settings' address (default: bound here). The socket is closed on
    return, whatever happened.
    """
    if sock is None:
        # Bound first: a port in use fails at once, before the model loads.
        try:
            sock = listen(settings.host, settings.port)
        except CannotListenError as exc:
            return _cannot_listen(exc)
    try:
        return _serve_on(sock, settings, engine_factory)
    finally:
        sock.close()


def _serve_on(sock: socket.socket, settings: ServerSettings, engine_factory: EngineFactory | None) -> int:
    """:func:`serve` on a listening socket (its caller closes it)."""
    import uvicorn

    from clef_runtime.jobs.store import JobStoreError
    from clef_runtime.server.app import create_app
    from clef_runtime.server.tls import uvicorn_tls_arguments

    fatal: list[BaseException] = []
    server_box: list[uvicorn.Server] = []

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server_box:
            server_box[0].should_exit = True

    try:
        app = create_app(settings, engine_factory=engine_factory, on_fatal=on_fatal)
    except JobStoreError as exc:
        logger.error("%s", exc)
        return 1
    config = uvicorn.Config(
        app,
        log_config=None,  # our logging config (configure_logging) applies to uvicorn's loggers too
        access_log=False,  # one line per request comes from the app, with its request id
        lifespan="on",
        timeout_graceful_shutdown=None,  # finish every accepted request
        server_header=False,
        **uvicorn_tls_arguments(settings),
    )
    server = uvicorn.Server(config)
    server_box.append(server)
    if not is_loopback(settings.host) and not settings.auth_enabled:
        # Only with --allow-unauthenticated: the settings refuse it otherwise.
        logger.warning(
            "listening on %s without --api-key (--allow-unauthenticated): anyone who can reach it can use it",
            settings.host,
        )
    logger.info("settings: %s", settings.redacted())
    if not settings.jobs:
        # The app logs the jobs database it opened, or why it opened none; with --jobs off it is silent.
        logger.info("batch jobs are off (--jobs off)")
    # uvicorn announces its address only for a socket it binds itself; this one was bound above.
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if settings.tls_enabled else "http"
    logger.info(
        "listening on %s://%s:%d (decision routes answer once the model is ready)", scheme, shown, port
    )
    # uvicorn re-raises the signal it caught after a graceful shutdown; with the default SIGTERM handler
    # that would kill the process with status 143. A no-op handler makes a graceful stop exit 0.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: None)
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if fatal:
        # The loader has logged what failed and what to do.
        logger.info("exiting with status 1: the model could not be loaded")
        return 1
    if not server.started:
        return 1
    logger.info("stopped")
    return 0


def run_serve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of ``clef serve`` after argument parsing. Returns the process exit status (2 for bad
    settings, :data:`EXIT_CANNOT_LISTEN` when the address cannot be bound)."""
    environ = os.environ if environ is None else environ
    try:
        settings = settings_from_namespace(args, environ)
        ray = RaySettings.from_sources(args, environ)
        if ray.ray and settings.tls_enabled:
            raise SettingsError(
                "--ssl-certfile is not served with --ray: Ray Serve's proxy answers HTTP; terminate TLS in "
                "front of it (an ingress or load balancer)"
            )
        check_tls_files(settings)
    except SettingsError as exc:
        print(f"clef serve: error: {exc}", file=sys.stderr)
        return 2
    engine_factory = None
    if settings.engine.calibration or settings.engine.head:
        # The model loads in the background; a bad calibration file or --head (a missing directory, a
        # malformed config) must fail here, before binding, as a usage error (exit 2), not as a load failure
        # seen only in the log. What was read goes on to the load.
        try:
            engine_factory = _engine_factory_with_checked_files(settings)
        except OptionsError as exc:
            print(f"clef serve: error: {exc}", file=sys.stderr)
            return 2
    try:
        sock = listen(settings.host, settings.port)
    except CannotListenError as exc:
        return _cannot_listen(exc)
    configure_logging(settings.log_level)
    if not ray.ray:
        return serve(settings, engine_factory=engine_factory, sock=sock)
    # Ray Serve's proxy binds the port itself, once Ray and the replicas have started: checked above.
    sock.close()
    from clef_runtime.scale.ray_serve import run_ray_serve

    return run_ray_serve(settings, ray)


def _engine_factory_with_checked_files(settings: ServerSettings) -> EngineFactory:
    """Check the files the engine options name (`check_engine_files`) and return the server's engine factory
    that loads the model with what was read. Raises `OptionsError` naming the flag and the file."""
    from clef_runtime.engine.preflight import check_engine_files
    from clef_runtime.server.runtime import load_clef

    files = check_engine_files(settings.engine)
    return lambda serving: load_clef(serving, checked_files=files)


def _cannot_listen(exc: CannotListenError) -> int:
    print(f"clef serve: error: {exc}", file=sys.stderr)
    return EXIT_CANNOT_LISTEN


def main(argv: list[str] | None = None) -> int:
    """``python -m clef_runtime.serve_command [flags]``: the serve command on its own."""
    parser = argparse.ArgumentParser(prog="clef serve", description="Serve a Clef model over HTTP.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
