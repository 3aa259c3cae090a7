"""Workers AI's REST route (``/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/clef-flash``) on the
System One flow, in Cloudflare's envelope. See :mod:`clef_runtime.protocol.workers_ai`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.convertors import PathConvertor, register_url_convertor

from clef_runtime.protocol.errors import format_loc
from clef_runtime.protocol.workers_ai import MODEL_PATHS, error_code, error_envelope, success_envelope
from clef_runtime.server.admission import authenticate
from clef_runtime.server.errors import ApiError, shaped_errors_route
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import SYSTEMONE, FinishedReply, WireMapping, answer_decision
from clef_runtime.server.openapi import request_body_doc
from clef_runtime.server.routes.systemone import SYSTEMONE_EXAMPLES

__all__ = ["FEATURE", "ROUTE", "WORKERS_AI", "router", "workers_ai_error_response"]


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


WORKERS_AI_DESCRIPTION = """\
Workers AI's REST route for Clef, so that code written against
`https://api.cloudflare.com/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/clef-flash` runs against
this server by changing the base URL. Any account id is accepted; the model path is
`@cf/cloudflare/clef-flash`
(or `@cf/cloudflare/clef`). The body is a System One request, the answer is its System One response in
Cloudflare's envelope (`{"result", "success", "errors", "messages"}`), and errors are in the same envelope
with Cloudflare's codes.
"""

WORKERS_AI_EXAMPLES: dict[str, dict[str, Any]] = {
    name: {**example, "summary": f"{example['summary']} (in Workers AI's envelope)"}
    for name, example in SYSTEMONE_EXAMPLES.items()
    if name in ("text", "json_state")
}


def workers_ai_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of Workers AI's route: the System One body schema and examples."""
    return request_body_doc("SystemOneRequest", "A System One request.", WORKERS_AI_EXAMPLES)


router = APIRouter(route_class=shaped_errors_route(workers_ai_error_response))


def _envelope(finished: FinishedReply, plan: None) -> Response:
    # finish() has added the x_ extras, metrics and the log line; the envelope wraps its body.
    return JSONResponse(success_envelope(finished.body), headers=finished.headers)


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


FEATURE = Feature("workers_ai", router)
"""Workers AI's route (its body is System One's, published by the System One feature)."""
