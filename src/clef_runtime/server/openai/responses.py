"""``POST /v1/responses``: OpenAI's Responses API with a JSON schema or a function tool, as one Clef decision.

The mapping lives in :mod:`clef_runtime.protocol.openai_responses`; this route runs it on the System One
flow (auth, limits, batching, state cache, metrics), streams the reply when asked (as the chat completions
route does, from the finished decision) and renders every error in OpenAI's shape.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.openai_responses import (
    ResponsesPlan,
    ResponsesRequest,
    parse_responses_request,
    to_response,
    to_response_events,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.server.errors import ApiError, shaped_errors_route
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import FinishedReply, Reply, WireMapping, answer_decision
from clef_runtime.server.openai.docs import (
    RESPONSES_DESCRIPTION,
    RESPONSES_REPLY_EXAMPLE,
    responses_request_body,
)
from clef_runtime.server.openai.errors import (
    OPENAI_ERROR_RESPONSES,
    openai_error_doc,
    openai_error_response,
    openai_validation_error,
)
from clef_runtime.server.openai.events import event_stream

__all__ = ["FEATURE", "RESPONSES", "router"]

router = APIRouter(route_class=shaped_errors_route(openai_error_response))

_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "description": "the event's type, e.g. response.output_text.delta"},
        "data": {"type": "string", "description": "the event as JSON (type, sequence_number, ...)"},
    },
    "required": ["event", "data"],
}

_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "A Response object: output holds one message (its output_text = the JSON object of "
        "the answers) or one function_call; x_decisions = the System One answers. With stream: true, the "
        "Responses event stream as server-sent events, ending with response.completed",
        "content": {
            "application/json": {"schema": {"type": "object"}, "example": RESPONSES_REPLY_EXAMPLE},
            # One schema per server-sent event, as OpenAPI tools read an event stream.
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    },
    400: openai_error_doc(
        "Invalid request, undecidable schema property, no schema, several tools and none named, "
        "previous_response_id / conversation / prompt (nothing is stored), n > 1 (param names the field)"
    ),
    **OPENAI_ERROR_RESPONSES,
}


def _responses_error(exc: RequestValidationError, plan: ResponsesPlan | None) -> ApiError:
    return openai_validation_error(exc, None if plan is None else partial(translate_error_loc, plan=plan))


def _to_systemone(data: Any) -> tuple[dict[str, Any], ResponsesPlan]:
    return to_systemone(parse_responses_request(data))


def _response(answer: dict[str, Any], plan: ResponsesPlan, reply: Reply) -> dict[str, Any]:
    return to_response(
        answer, plan, request_id=reply.request_id, created=0 if reply.deterministic else int(time.time())
    )


def _stream_if_asked(finished: FinishedReply, plan: ResponsesPlan) -> Response:
    """With ``stream: true``: the Response object as the Responses event stream, each event an SSE
    ``event: <type>`` with its JSON as ``data`` (no ``[DONE]``: OpenAI ends this stream with
    ``response.completed``)."""
    if not plan.stream:
        return finished.as_json()
    return event_stream(to_response_events(finished.body), finished.headers, named=True, done=False)


RESPONSES: WireMapping[ResponsesPlan] = WireMapping(
    to_systemone=_to_systemone, from_systemone=_response, error=_responses_error, reply=_stream_if_asked
)
"""``/v1/responses`` onto System One: the text format's or the chosen tool's decidable properties."""


@router.post(
    "/v1/responses",
    summary="OpenAI Responses API: a JSON schema's or function tool's enum/boolean/bounded-integer fields, "
    "decided at once",
    response_model=None,
    responses=_RESPONSES,
    description=RESPONSES_DESCRIPTION,
    openapi_extra=responses_request_body(),
)
async def responses(request: Request) -> Response:
    """Map the request onto System One, answer it, reply with a Response object (or its event stream)."""
    return await answer_decision(request, RESPONSES)


FEATURE = Feature("responses", router, request_models=(ResponsesRequest,))
"""``POST /v1/responses`` (its paths' error shape comes with the chat feature's)."""
