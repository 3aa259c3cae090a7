"""``POST /v1/decisions``: the OpenAI-shaped decisions API, mapped onto the same engine.

See :mod:`clef_runtime.protocol.decisions` for the field mapping.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from clef_runtime.protocol.decisions import (
    DecisionResponse,
    parse_decisions_request,
    to_decision_response,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.server.errors import from_protocol_error, validation_error
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
from clef_runtime.server.openapi_docs import DECISIONS_DESCRIPTION, decisions_request_body
from clef_runtime.server.runtime import ClientGone

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/decisions",
    summary="Answer OpenAI-shaped decision questions (predicate / choice / score)",
    response_model=None,
    responses={
        200: {"model": DecisionResponse, "description": "Answers in question order"},
        **ERROR_RESPONSES,
    },
    description=DECISIONS_DESCRIPTION,
    openapi_extra=decisions_request_body(),
)
async def decisions(request: Request) -> Response:
    """Map the request onto System One, answer it with the engine, map the answers back."""
    authenticate(request)
    runtime = runtime_of(request)
    runtime.require_ready()
    plan = None
    try:
        with runtime.arrival() as arrival:
            data = await read_json_body(request)
            parsed = parse_decisions_request(data)
            systemone_body, plan = to_systemone(parsed)
            prepared = await runtime.prepare(systemone_body)
            answer = await runtime.decide(prepared, request, arrival)
    except (BodyClientGone, ClientGone):
        return client_gone_response(request)
    except RequestValidationError as exc:
        if plan is not None and not isinstance(exc, InputTooLongError):
            # Found in the mapped System One request: point at the decisions field instead.
            errors = [{**err, "loc": translate_error_loc(tuple(err["loc"]), plan)} for err in exc.errors]
            error = validation_error(errors)
        else:
            error = from_protocol_error(exc)
        note(request, error_type=error.error_type)
        raise error from None
    return finish(request, to_decision_response(answer, plan), prepared, answer)
