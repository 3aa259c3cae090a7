"""What a feature of the server is to the application that assembles it (`clef_runtime.server.app`).

A feature package (System One and the other decision routes, OpenAI's routes, MCP, saved classifiers, jobs,
the pages) exposes one `Feature`: its router and, where it needs them, a hook that opens what it owns before
the server listens (and returns what runs while it serves), its paragraph of the OpenAPI description, the
request schemas its routes validate by hand, and the error shape of the paths it speaks for. The HTTP core
never imports a feature; features do not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, ExitStack
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel

from clef_runtime.server.errors import PathShaper

__all__ = ["Attach", "Feature"]

Attach = Callable[[FastAPI, ExitStack], "AbstractAsyncContextManager[None] | None"]
"""Called once while the app is built, after ``app.state`` has ``settings``, ``runtime`` and ``metrics``:
open what the feature owns (a failure stops the server before it listens), register its closing on the
stack (closed after the server stopped, or at once if a later feature fails to open), and return what runs
while the server serves (entered when it starts, left when it stops, in reverse order), or None."""


@dataclass(frozen=True)
class Feature:
    """One feature of the server."""

    name: str
    router: APIRouter
    attach: Attach | None = None
    description: str = ""
    """A paragraph of the OpenAPI description (/docs), after the server's own."""
    request_models: tuple[type[BaseModel], ...] = ()
    """Request bodies its routes read and validate by hand: their schemas are published in OpenAPI."""
    error_shaper: PathShaper | None = None
    """Another API's error shape for the HTTP errors (404, 405) of the paths it speaks for."""
