"""Starting or joining Ray, the same way for ``clef serve --ray`` and ``clef batch --ray``: a local head bound
to 127.0.0.1 (never every interface) with this machine's CPUs, or an existing cluster, with Ray's own
variables set for plain, complete logs."""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["RAY_ENVIRONMENT", "start_ray"]

RAY_ENVIRONMENT = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray prints each replica's lines behind a "(ServeReplica:... pid=N)" prefix in ANSI colours: plain text.
    "RAY_COLOR_PREFIX": "0",
    # Ray folds lines that look alike into "[repeated Nx across cluster]" (in colour): a server log keeps
    # every request's line.
    "RAY_DEDUP_LOGS": "0",
}
"""Defaults for Ray's own variables (a variable already set wins), read when Ray is imported and started."""


def start_ray(address: str | None) -> None:
    """``ray.init``: a local head on 127.0.0.1 when ``address`` is None (stopped by ``ray.shutdown()``, with
    every process it started), else join ``address`` (``auto``, ``ray://head:10001``, ``host:port``)."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import ray

    init: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address is None:
        init.update(_node_ip_address="127.0.0.1", num_cpus=os.cpu_count() or 1)
    else:
        init["address"] = address
    ray.init(**init)
