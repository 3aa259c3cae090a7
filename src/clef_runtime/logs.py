"""The log format of every clef-runtime process: one line per record on stderr, for our loggers and the
libraries' alike (uvicorn's, huggingface_hub's). ``clef serve`` sets it up in its own process, and each Ray
Serve replica of ``clef serve --ray`` in its process, so a replica's lines read like the server's."""

from __future__ import annotations

import logging
import sys

__all__ = ["LOG_FORMAT", "configure_logging"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Send every record at ``level`` (``info``, ``debug``, ...) and above to stderr, one line each."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT, stream=sys.stderr, force=True
    )
    # huggingface_hub adds a handler of its own to its logger: with ours on the root, each of its warnings
    # (download retries) would print twice. Its records go through ours alone.
    hub_logger = logging.getLogger("huggingface_hub")
    import huggingface_hub.utils.logging  # noqa: F401  (adds that handler now, so it can be removed)

    for handler in list(hub_logger.handlers):
        hub_logger.removeHandler(handler)
    hub_logger.propagate = True
