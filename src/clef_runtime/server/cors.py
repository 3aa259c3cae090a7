"""Cross-origin calls from browser pages (``--cors-origin``).

Off by default: a page of another site gets no ``Access-Control-Allow-Origin`` and its browser withholds
the answer; the server's own pages (playground, status) are same-origin and need none. With origins
configured, Starlette's CORS middleware, outermost, answers preflights before auth (a preflight carries no
key) and adds the headers to every answer, errors included, so a page can read a 401 or a 429. No cookies
are used, so credentials stay off and any request header is allowed: the key travels in ``Authorization``
or ``X-API-Key``, and SDKs running in browsers add headers of their own (the OpenAI SDK's ``x-stainless-*``).
"""

from __future__ import annotations

from collections.abc import Collection

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

__all__ = ["EXPOSED_HEADERS", "add_cors", "origin_allowed"]

EXPOSED_HEADERS = (
    "x-request-id",
    "x-typesafe-request-id",
    "x-clef-head",
    "x-clef-state-cache",
    "x-clef-cached-tokens",
    "x-clef-steps",
    "x-clef-replica",
    "x-latency-ms",
    "x-total-time",
    "x-queue-time",
    "x-inference-time",
    "x-compute-tokens",
    "retry-after",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
)
"""Response headers a cross-origin page may read (beyond the CORS-safelisted ones)."""


def add_cors(app: FastAPI, origins: Collection[str]) -> None:
    """Let pages of ``origins`` (``*``: any) call every route of ``app``; nothing without origins. Call it
    after every other middleware, so that it is the outermost."""
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=list(EXPOSED_HEADERS),
        max_age=600,
    )


def origin_allowed(origin: str, origins: Collection[str]) -> bool:
    """Whether ``--cors-origin`` lets a page of ``origin`` call the server."""
    return "*" in origins or origin in origins
