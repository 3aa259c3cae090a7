"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, for the routes that speak
OpenAI's API (``/v1/chat/completions``, ``/v1/responses``) and for unknown ``/v1/...`` routes, so that an
OpenAI SDK pointed at this server shows the message and the field instead of a bare status code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.protocol.openai_chat import error_param, openai_error_body
from clef_runtime.server.errors import ApiError, ErrorShaper, validation_error

__all__ = [
    "OPENAI_ERROR_RESPONSES",
    "OPENAI_ERROR_SCHEMA",
    "OPENAI_PATHS",
    "openai_error_doc",
    "openai_error_response",
    "openai_shaped_paths",
    "openai_validation_error",
]

Loc = tuple[str | int, ...]


def openai_error_response(error: ApiError) -> Response:
    """An error in OpenAI's shape. Validation errors (422 elsewhere) are 400 as OpenAI answers them, with
    ``param`` naming the field and ``code`` the problem (``context_length_exceeded`` for an input over the
    token limit); other statuses are kept, with their error type."""
    status, error_type, code, param = error.status, error.error_type, None, None
    message = error.message
    if error.validation:
        first = error.validation[0]
        param = error_param(tuple(first.get("loc", ())))
        code = str(first.get("type", "invalid_value"))
        message = f"{param or 'body'}: {first.get('msg', '')}"
        if len(error.validation) > 1:
            message += f" (and {len(error.validation) - 1} more)"
        status, error_type = 400, "invalid_request_error"
        if code == "json_invalid":
            param = None  # the location is a character position in the body, not a field
            message = str(first.get("msg", ""))
    elif status == 401:
        error_type, code = "invalid_request_error", "invalid_api_key"
    elif status in (404, 405):
        error_type, code = "invalid_request_error", "unknown_url" if status == 404 else "method_not_allowed"
    return JSONResponse(
        openai_error_body(message, error_type, param, code), status_code=status, headers=error.headers
    )


OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/responses"})
"""The routes that speak OpenAI's API: their 405 (a wrong method) is in OpenAI's shape too."""


def openai_shaped_paths(request: Request, status: int) -> ErrorShaper | None:
    """OpenAI's error shape for the HTTP errors of its routes and for every unknown ``/v1/...`` route: an
    OpenAI SDK pointed at this server shows the message instead of a bare "Error code: 404"."""
    path = request.url.path
    if path in OPENAI_PATHS or (status == 404 and path.startswith("/v1/")):
        return openai_error_response
    return None


OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
"""The JSON schema of OpenAI's error body (OpenAPI docs)."""


def openai_error_doc(description: str) -> dict[str, Any]:
    """An OpenAPI response entry whose body is OpenAI's error."""
    return {"description": description, "content": {"application/json": {"schema": OPENAI_ERROR_SCHEMA}}}


OPENAI_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: openai_error_doc("Missing or wrong API key (auth on)"),
    413: openai_error_doc("Body over --max-body-bytes"),
    415: openai_error_doc(
        "Unsupported Content-Encoding, multipart body, or a form-typed body that is not JSON"
    ),
    429: openai_error_doc("Queue full; see Retry-After"),
    500: openai_error_doc("Internal error; the message names the request id"),
    503: openai_error_doc("Model not loaded yet (or shutting down); see Retry-After"),
}
"""The OpenAPI entries of the errors every OpenAI route shares (each adds its own 400 and 200)."""


def openai_validation_error(
    exc: RequestValidationError, to_route_loc: Callable[[Loc], Loc] | None
) -> ApiError:
    """``exc`` with the locations found in the mapped System One request pointed at the route's own fields
    (``to_route_loc``; None when the route's body itself was invalid); an input over the token limit becomes
    OpenAI's 400 ``context_length_exceeded``."""
    errors = exc.errors
    if to_route_loc is not None:
        errors = [{**err, "loc": to_route_loc(tuple(err["loc"]))} for err in exc.errors]
    if isinstance(exc, InputTooLongError):
        first = {**errors[0], "type": "context_length_exceeded"}
        return ApiError(400, "invalid_request_error", str(first["msg"]), validation=[first])
    return validation_error(errors)
