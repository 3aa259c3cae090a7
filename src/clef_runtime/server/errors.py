"""Error bodies and the one place where exceptions become HTTP responses.

Two body shapes, as TypeSafe's API and FastAPI use them:

* validation (422): ``{"detail": [{"loc": ["body", ...], "msg": str, "type": str}, ...]}``
* everything else: ``{"detail": {"error_type": str, "message": str}}`` (plus optional extra keys such as
  ``request_id``, ``input_tokens``, ``limit``).

A route that speaks another API's error shape (OpenAI's, Cloudflare's) uses a router built with
``route_class=shaped_errors_route(shaper)``: every error its endpoint raises (:class:`ApiError`, protocol
errors, HTTP exceptions, and unexpected exceptions as a 500) goes through ``shaper`` instead of the
handlers below, so the System One routes' bodies stay exactly as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from clef_runtime.engine.head_records import HeadChangedError, HeadError, HeadNotLoadedError, HeadRefusedError
from clef_runtime.protocol.errors import ErrorItem, InputTooLongError, RequestValidationError
from clef_runtime.protocol.plain_errors import plain_message
from clef_runtime.server.context import context_of

__all__ = [
    "ERROR_RESPONSES",
    "ApiError",
    "ClientGone",
    "ErrorShaper",
    "PathShaper",
    "as_api_error",
    "error_body",
    "install_error_handlers",
    "shaped_errors_route",
    "too_long_error",
    "validation_body",
    "validation_error",
]

logger = logging.getLogger("clef_runtime.server")

_STATUS_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "request_too_large",
    415: "unsupported_media_type",
    429: "queue_full",
    499: "client_closed_request",
    500: "internal_error",
    503: "not_ready",
}


class ClientGone(Exception):
    """The client disconnected: while its body was being read, or before its answer was ready (the work was
    dropped if it had not started). Answered with 499 in logs and metrics, never delivered."""


class ApiError(Exception):
    """An HTTP error with the ``{"detail": {"error_type", "message"}}`` body (or a validation list)."""

    def __init__(
        self,
        status: int,
        error_type: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
        validation: Sequence[ErrorItem] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})
        self.validation = list(validation) if validation is not None else None

    def body(self) -> dict[str, Any]:
        """The JSON body of this error."""
        if self.validation is not None:
            return validation_body(self.validation)
        return error_body(self.error_type, self.message, **self.extra)

    def response(self) -> JSONResponse:
        """This error as a response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(error_type: str, message: str, **extra: Any) -> dict[str, Any]:
    """``{"detail": {"error_type": error_type, "message": message, **extra}}``."""
    return {"detail": {"error_type": error_type, "message": message, **extra}}


def _jsonable_loc(loc: Sequence[Any]) -> list[str | int]:
    return [part if isinstance(part, int) and not isinstance(part, bool) else str(part) for part in loc]


def validation_body(errors: Sequence[ErrorItem]) -> dict[str, Any]:
    """``{"detail": [{"loc": ["body", ...], "msg", "type"}]}``; ``body`` is prefixed when missing."""
    detail = []
    for err in errors:
        loc = _jsonable_loc(err.get("loc", ()))
        if loc[:1] != ["body"]:
            loc = ["body", *loc]
        detail.append(
            {"loc": loc, "msg": str(err.get("msg", "")), "type": str(err.get("type", "value_error"))}
        )
    return {"detail": detail}


def validation_error(errors: Sequence[ErrorItem]) -> ApiError:
    """A 422 carrying ``errors`` (locations relative to the body)."""
    first = errors[0] if errors else {"msg": "invalid request"}
    return ApiError(422, "invalid_request_error", str(first.get("msg")), validation=errors)


def too_long_error(exc: InputTooLongError) -> ApiError:
    """The 413 for an input over the token limit, naming the counts."""
    return ApiError(
        413,
        exc.error_type,
        exc.message,
        extra={"input_tokens": exc.input_tokens, "limit": exc.limit},
    )


def from_protocol_error(exc: RequestValidationError) -> ApiError:
    """Map the protocol layer's validation errors: input too long -> 413, everything else -> 422."""
    if isinstance(exc, InputTooLongError):
        return too_long_error(exc)
    return validation_error(exc.errors)


def head_error(exc: HeadError) -> ApiError:
    """A head that cannot answer, as HTTP: 404 ``head_not_loaded`` (with the heads served), 409
    ``head_changed`` (with both digests), and for ``/v1/heads`` calls 409 for a conflict or 422 at the
    field at fault."""
    if isinstance(exc, HeadNotLoadedError):
        return ApiError(
            404, exc.error_type, exc.message, extra={"head": exc.name, "served": list(exc.served)}
        )
    if isinstance(exc, HeadChangedError):
        return ApiError(
            409,
            exc.error_type,
            exc.message,
            extra={"head": exc.name, "digest_pinned": exc.pinned, "digest_served": exc.served},
        )
    if isinstance(exc, HeadRefusedError) and not exc.conflict:
        return validation_error([{"loc": (exc.field,), "msg": exc.message, "type": exc.error_type}])
    return ApiError(409, exc.error_type, exc.message)


def as_api_error(exc: Exception) -> ApiError | None:
    """``exc`` as an :class:`ApiError` (protocol errors -> 422/413, HTTP exceptions keep their status), or
    None for an exception that is not a client-facing error."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        return from_protocol_error(exc)
    if isinstance(exc, HeadError):
        return head_error(exc)
    if isinstance(exc, StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        error_type = _STATUS_ERROR_TYPES.get(exc.status_code, "http_error")
        return ApiError(exc.status_code, error_type, message, headers=exc.headers)
    return None


ErrorShaper = Callable[[ApiError], Response]
"""Renders an error in a route's own API shape."""


def shaped_errors_route(shaper: ErrorShaper) -> type[APIRoute]:
    """A route class whose endpoint errors are rendered by ``shaper`` (see the module docstring).

    Unexpected exceptions are logged with the request id and rendered as a 500 ``internal_error`` naming
    it, as the middleware does for the other routes.
    """

    class ShapedErrorsRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def shaped(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:
                    error = as_api_error(exc)
                    if error is None:
                        request_id = context_of(request).request_id
                        logger.exception("request_id=%s internal error", request_id)
                        error = ApiError(
                            500,
                            "internal_error",
                            f"internal server error; quote request id {request_id} when reporting it",
                        )
                    context_of(request).error_type = error.error_type
                    return shaper(error)

            return shaped

    return ShapedErrorsRoute


PathShaper = Callable[[Request, int], "ErrorShaper | None"]
"""Which shaper renders an HTTP error (404 no route, 405 wrong method) raised before any endpoint ran, by
the request's path and status: None for the default shape."""


def install_error_handlers(app: FastAPI, path_shaper: PathShaper | None = None) -> None:
    """Register the handlers that give every error the shapes above (``path_shaper``: another API's shape
    for the HTTP errors of the paths it speaks for)."""

    async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def handle_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error_type = _STATUS_ERROR_TYPES.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        error = ApiError(exc.status_code, error_type, message, headers=dict(exc.headers or {}))
        shaper = path_shaper(request, exc.status_code) if path_shaper is not None else None
        return error.response() if shaper is None else shaper(error)

    async def handle_fastapi_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, FastAPIValidationError)
        errors = [
            {"loc": tuple(e.get("loc", ())), "msg": plain_message(e), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        # FastAPI's own locations already start with body/query/header.
        detail = [
            {"loc": _jsonable_loc(e["loc"]), "msg": str(e["msg"]), "type": str(e["type"])} for e in errors
        ]
        return JSONResponse({"detail": detail}, status_code=422)

    async def handle_protocol_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_protocol_error(exc).response()

    app.add_exception_handler(ApiError, handle_api_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_exception)
    app.add_exception_handler(FastAPIValidationError, handle_fastapi_validation)
    app.add_exception_handler(RequestValidationError, handle_protocol_error)

    async def handle_head_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HeadError)
        return head_error(exc).response()

    app.add_exception_handler(HeadError, handle_head_error)


def _error_doc(description: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "detail": {
                "type": "object",
                "properties": {"error_type": {"type": "string"}, "message": {"type": "string"}},
                "required": ["error_type", "message"],
            }
        },
    }
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_VALIDATION_DOC = {
    "description": "Validation error (also malformed JSON)",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "detail": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "loc": {
                                    "type": "array",
                                    "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                },
                                "msg": {"type": "string"},
                                "type": {"type": "string"},
                            },
                            "required": ["loc", "msg", "type"],
                        },
                    }
                },
            }
        }
    },
}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error_doc("Undecodable body (corrupt compression, bad Content-Length)"),
    401: _error_doc("Missing or wrong API key (auth on)"),
    413: _error_doc("Body over --max-body-bytes, or input over the token limit with --on-overflow reject"),
    415: _error_doc("Unsupported Content-Encoding, multipart body, or a form-typed body that is not JSON"),
    422: _VALIDATION_DOC,
    429: _error_doc("Queue full, or over this caller's --rate-limit; see Retry-After"),
    500: _error_doc("Internal error; the message names the request id"),
    503: _error_doc(
        "Model not loaded yet, shutting down, or waited past --queue-timeout-ms without starting; "
        "see Retry-After"
    ),
}
