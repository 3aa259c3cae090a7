"""``POST /v1/responses``: OpenAI's Responses API with a JSON schema or a function tool, as one Clef decision.

The mapping lives in :mod:`clef_runtime.protocol.openai_responses`; this route runs it on the System One
flow (auth, limits, batching, state cache, metrics), streams the reply when asked (as the chat completions
route does, from the finished decision) and renders every error in OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from clef_runtime.protocol.openai_responses import (
    ResponsesPlan,
    ResponsesRequest,
    parse_responses_request,
    to_response,
    to_response_events,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import FinishedReply, Reply, WireMapping, answer_decision
from clef_runtime.server.openai.docs import (
    RESPONSES_DESCRIPTION,
    RESPONSES_REPLY_EXAMPLE,
    responses_request_body,
)
from clef_runtime.server.openai.replies import (
    event_stream,
    openai_mapping,
    openai_responses_doc,
    openai_router,
    sse_event_doc,
)

__all__ = ["FEATURE", "RESPONSES", "router"]

router = openai_router()

_SSE_EVENT = sse_event_doc(
    "the event as JSON (type, sequence_number, ...)", "the event's type, e.g. response.output_text.delta"
)

_RESPONSES = openai_responses_doc(
    "A Response object: output holds one message (its output_text = the JSON object of the answers) or one "
    "function_call; x_decisions = the System One answers. With stream: true, the Responses event stream as "
    "server-sent events, ending with response.completed",
    {"schema": {"type": "object"}, "example": RESPONSES_REPLY_EXAMPLE},
    _SSE_EVENT,
    "Invalid request, undecidable schema property, no schema, several tools and none named, "
    "previous_response_id / conversation / prompt (nothing is stored), n > 1 (param names the field)",
)


def _response(answer: dict[str, Any], plan: ResponsesPlan, reply: Reply) -> dict[str, Any]:
    return to_response(answer, plan, request_id=reply.request_id, created=reply.timestamp())


def _events(finished: FinishedReply, plan: ResponsesPlan) -> Response:
    """The Response object as the Responses event stream, each event an SSE ``event: <type>`` with its JSON
    as ``data`` (no ``[DONE]``: OpenAI ends this stream with ``response.completed``)."""
    return event_stream(to_response_events(finished.body), finished.headers, named=True, done=False)


RESPONSES: WireMapping[ResponsesPlan] = openai_mapping(
    lambda data: to_systemone(parse_responses_request(data)), translate_error_loc, _response, _events
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
