"""``clef serve``: flags, logging, and running uvicorn with a graceful SIGTERM.

The lead's ``clef_runtime.cli`` wires the subcommand with :func:`add_serve_arguments` and :func:`run_serve`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from clef_runtime.options import add_option_arguments
from clef_runtime.server.settings import (
    ALL_SERVE_OPTIONS,
    ServerSettings,
    SettingsError,
    settings_from_namespace,
)

if TYPE_CHECKING:
    from clef_runtime.server.runtime import EngineFactory

__all__ = ["add_serve_arguments", "configure_logging", "run_serve", "serve"]

logger = logging.getLogger("clef_runtime.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``clef serve`` flag to ``parser``: the model, the engine's options, the server's own. Each
    flag defaults to its ``CLEF_*`` variable, then to the built-in default (resolved in :func:`run_serve`,
    so ``--help`` shows the variable names)."""
    add_option_arguments(parser, ALL_SERVE_OPTIONS)


def configure_logging(level: str) -> None:
    """One line per record on stderr, for our loggers and uvicorn's alike."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # huggingface_hub adds a handler of its own to its logger: with ours on the root, each of its warnings
    # (download retries) would print twice. Its records go through ours alone.
    hub_logger = logging.getLogger("huggingface_hub")
    import huggingface_hub.utils.logging  # noqa: F401  (adds that handler now, so it can be removed)

    for handler in list(hub_logger.handlers):
        hub_logger.removeHandler(handler)
    hub_logger.propagate = True


def serve(settings: ServerSettings, *, engine_factory: EngineFactory | None = None) -> int:
    """Run the server until SIGTERM/SIGINT, then finish accepted requests and return.

    Returns 0 after a graceful stop, 1 if the model failed to load or the port could not be bound.
    ``engine_factory`` (tests, embedding) replaces ``Clef.load``.
    """
    import uvicorn

    from clef_runtime.server.app import create_app

    fatal: list[BaseException] = []
    server_box: list[uvicorn.Server] = []

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        if server_box:
            server_box[0].should_exit = True

    from clef_runtime.jobs.store import JobStoreError

    try:
        app = create_app(settings, engine_factory=engine_factory, on_fatal=on_fatal)
    except JobStoreError as exc:
        logger.error("%s", exc)
        return 1
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # our logging config (configure_logging) applies to uvicorn's loggers too
        access_log=False,  # one line per request comes from the app, with its request id
        lifespan="on",
        timeout_graceful_shutdown=None,  # finish every accepted request
        server_header=False,
    )
    server = uvicorn.Server(config)
    server_box.append(server)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.auth_enabled:
        logger.warning("listening on %s without --api-key: anyone who can reach it can use it", settings.host)
    logger.info("settings: %s", settings.redacted())
    # uvicorn re-raises the signal it caught after a graceful shutdown; with the default SIGTERM handler
    # that would kill the process with status 143. A no-op handler makes a graceful stop exit 0.
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: None)
    try:
        server.run()
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
    settings)."""
    try:
        settings = settings_from_namespace(args, os.environ if environ is None else environ)
    except SettingsError as exc:
        print(f"clef serve: error: {exc}", file=sys.stderr)
        return 2
    if settings.engine.calibration:
        # The model loads in the background; a bad calibration file must fail here, before binding, as a
        # usage error (exit 2), not as a load failure seen only in the log.
        from clef_runtime.engine.calibration import Calibration, CalibrationError

        try:
            Calibration.load(settings.engine.calibration)
        except CalibrationError as exc:
            print(f"clef serve: error: {exc}", file=sys.stderr)
            return 2
    configure_logging(settings.log_level)
    if settings.ray:
        from clef_runtime.scale.ray_serve import run_ray_serve

        return run_ray_serve(settings)
    return serve(settings)


def main(argv: list[str] | None = None) -> int:
    """``python -m clef_runtime.server.cli [flags]``: the serve command on its own."""
    parser = argparse.ArgumentParser(prog="clef serve", description="Serve a Clef model over HTTP.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
