"""Workers AI's REST route (``/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/clef-flash``) on the
System One flow, in Cloudflare's envelope. See :mod:`clef_runtime.protocol.workers_ai`."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.convertors import PathConvertor, register_url_convertor

from clef_runtime.protocol.errors import format_loc
from clef_runtime.protocol.workers_ai import MODEL_PATHS, error_code, error_envelope, success_envelope
from clef_runtime.server.errors import ApiError, shaped_errors_route
from clef_runtime.server.flow import SYSTEMONE, WireMapping, answer_decision
from clef_runtime.server.handling import authenticate
from clef_runtime.server.openapi_docs import WORKERS_AI_DESCRIPTION, workers_ai_request_body

__all__ = ["ROUTE", "WORKERS_AI", "router", "workers_ai_error_response"]


class _AnyModelPath(PathConvertor):
    """Starlette's ``path`` with newlines too: a model path holding a control character is then an unknown
    model (400 in the envelope, naming it) rather than a bare 404 that matches no route."""

    regex = r"[\s\S]*"


register_url_convertor("clef_model_path", _AnyModelPath())

ROUTE = "/client/v4/accounts/{account_id}/ai/run/{model_path:clef_model_path}"


def workers_ai_error_response(error: ApiError) -> Response:
    """An error in Cloudflare's envelope, with the error's HTTP status; a validation error's message names
    the field (``questions.q1.criteria: ...``)."""
    message = error.message
    if error.validation:
        parts = []
        for err in error.validation:
            loc = tuple(err.get("loc", ()))
            loc = loc[1:] if loc[:1] == ("body",) else loc
            parts.append(f"{format_loc(loc)}: {err.get('msg', '')}")
        message = "; ".join(parts)
    return JSONResponse(
        error_envelope(error_code(error.status, error.error_type), message),
        status_code=error.status,
        headers=error.headers,
    )


router = APIRouter(route_class=shaped_errors_route(workers_ai_error_response))


def _envelope(response: JSONResponse, plan: None) -> Response:
    # finish() has added the x_ extras, metrics and the log line; the envelope wraps its body.
    result = json.loads(bytes(response.body))
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")
    }
    return JSONResponse(success_envelope(result), headers=headers)


WORKERS_AI: WireMapping[None] = WireMapping(
    to_systemone=SYSTEMONE.to_systemone, from_systemone=SYSTEMONE.from_systemone, reply=_envelope
)
"""Workers AI's route: a System One body, its answer in Cloudflare's envelope."""

_ENVELOPE_ERROR = {
    "type": "object",
    "properties": {
        "result": {"type": "null"},
        "success": {"type": "boolean"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"code": {"type": "integer"}, "message": {"type": "string"}},
                "required": ["code", "message"],
            },
        },
        "messages": {"type": "array"},
    },
    "required": ["result", "success", "errors", "messages"],
}


_ENVELOPE_OK = {
    "type": "object",
    "properties": {
        "result": {"$ref": "#/components/schemas/SystemOneResponse"},
        "success": {"type": "boolean"},
        "errors": {"type": "array"},
        "messages": {"type": "array"},
    },
    "required": ["result", "success", "errors", "messages"],
}


def _error_doc(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ENVELOPE_ERROR}}}


@router.post(
    ROUTE,
    summary="Workers AI's route for @cf/cloudflare/clef-flash (or .../clef), in Cloudflare's envelope",
    response_model=None,
    responses={
        200: {
            "description": "{result: <System One response>, success: true, errors: [], messages: []}",
            "content": {"application/json": {"schema": _ENVELOPE_OK}},
        },
        400: _error_doc("Unknown model path (code 5007) or undecodable body (3003)"),
        401: _error_doc("Missing or wrong API token (code 10000)"),
        413: _error_doc("Body or input too large (code 3006)"),
        415: _error_doc("Unsupported Content-Type / Content-Encoding (code 3003)"),
        422: _error_doc("Invalid body (code 5006); the message names the field"),
        429: _error_doc("Queue full (code 3040); see Retry-After"),
        500: _error_doc("Internal error; the message names the request id"),
        503: _error_doc("Model not loaded yet or shutting down (code 3040); see Retry-After"),
    },
    description=WORKERS_AI_DESCRIPTION,
    openapi_extra=workers_ai_request_body(),
)
async def workers_ai_run(request: Request, account_id: str, model_path: str) -> Response:
    """Answer a System One body for any account id, as Workers AI does for Clef."""
    authenticate(request)
    if model_path not in MODEL_PATHS:
        raise ApiError(
            400,
            "no_such_model",
            f"No such model {model_path} or task (this server answers {' and '.join(MODEL_PATHS)})",
        )
    return await answer_decision(request, WORKERS_AI)
