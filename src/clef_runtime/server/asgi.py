"""What our pure ASGI middlewares share: they wrap an app and act on HTTP requests only."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["HttpMiddleware"]


class HttpMiddleware:
    """A pure ASGI middleware that passes every scope but HTTP (lifespan, websockets) through untouched and
    handles HTTP requests in `handle`. Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``: it sees
    every message, streams included, and adds no task per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request (``scope["type"] == "http"``)."""
        raise NotImplementedError
