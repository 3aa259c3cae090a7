"""``POST /v1/systemone``: the System One API."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.systemone import SystemOneResponse
from clef_runtime.server.errors import from_protocol_error
from clef_runtime.server.handling import (
    ERROR_RESPONSES,
    BodyClientGone,
    authenticate,
    client_gone_response,
    finish,
    note,
    read_json_body,
    runtime_of,
)
from clef_runtime.server.openapi_docs import SYSTEMONE_DESCRIPTION, systemone_request_body
from clef_runtime.server.runtime import ClientGone

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/systemone",
    summary="Answer System One questions about a state",
    response_model=None,
    responses={
        200: {"model": SystemOneResponse, "description": "One answer per question id"},
        **ERROR_RESPONSES,
    },
    description=SYSTEMONE_DESCRIPTION,
    openapi_extra=systemone_request_body(),
)
async def systemone(request: Request) -> Response:
    """Validate, encode (off the event loop), queue for the batcher, answer.

    Top-level extras: ``x_truncated_state_tokens`` (state tokens cut to fit) and ``x_latency_ms``.
    """
    authenticate(request)
    runtime = runtime_of(request)
    runtime.require_ready()
    try:
        with runtime.arrival() as arrival:
            data = await read_json_body(request)
            prepared = await runtime.prepare(data)
            answer = await runtime.decide(prepared, request, arrival)
    except (BodyClientGone, ClientGone):
        return client_gone_response(request)
    except RequestValidationError as exc:
        error = from_protocol_error(exc)
        note(request, error_type=error.error_type)
        raise error from None
    return finish(request, answer, prepared)
