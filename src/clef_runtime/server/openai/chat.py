"""``POST /v1/chat/completions``: OpenAI structured outputs answered as one Clef decision.

The mapping lives in :mod:`clef_runtime.protocol.openai_chat`; this route runs it on the System One flow
(auth, limits, batching, state cache, metrics) and renders every error in OpenAI's shape.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.openai_chat import (
    ChatCompletionRequest,
    ChatPlan,
    parse_chat_request,
    to_chat_chunks,
    to_chat_completion,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.server.errors import ApiError, shaped_errors_route
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import FinishedReply, Reply, WireMapping, answer_decision
from clef_runtime.server.openai.docs import CHAT_DESCRIPTION, chat_request_body
from clef_runtime.server.openai.errors import (
    OPENAI_ERROR_RESPONSES,
    openai_error_doc,
    openai_error_response,
    openai_shaped_paths,
    openai_validation_error,
)
from clef_runtime.server.openai.events import event_stream

__all__ = ["CHAT", "FEATURE", "router"]

router = APIRouter(route_class=shaped_errors_route(openai_error_response))

_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "a chat.completion.chunk as JSON, or [DONE] last"},
    },
    "required": ["data"],
}


_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "A chat.completion (content = the JSON object of the answers; x_decisions = the "
        "System One answers), or with stream: true its chunks as server-sent events ending with data: [DONE]",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # One schema per server-sent event (as OpenAPI tools read an event stream): its data is a
            # chat.completion.chunk in JSON, and the last event's data is the literal [DONE].
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    },
    400: openai_error_doc(
        "Invalid request, undecidable schema property, n > 1, several tools and none named, no schema "
        "(param names it)"
    ),
    **OPENAI_ERROR_RESPONSES,
}


def _chat_error(exc: RequestValidationError, plan: ChatPlan | None) -> ApiError:
    return openai_validation_error(exc, None if plan is None else partial(translate_error_loc, plan=plan))


def _to_systemone(data: Any) -> tuple[dict[str, Any], ChatPlan]:
    return to_systemone(parse_chat_request(data))


def _completion(answer: dict[str, Any], plan: ChatPlan, reply: Reply) -> dict[str, Any]:
    return to_chat_completion(
        answer,
        plan,
        completion_id=f"chatcmpl-{reply.request_id}",
        created=0 if reply.deterministic else int(time.time()),
    )


def _stream_if_asked(finished: FinishedReply, plan: ChatPlan) -> Response:
    """With ``stream: true``: the completion's chunks as server-sent events ending with ``[DONE]``."""
    if not plan.stream:
        return finished.as_json()
    chunks = to_chat_chunks(finished.body, plan)
    return event_stream(chunks, finished.headers, named=False, done=True)


CHAT: WireMapping[ChatPlan] = WireMapping(
    to_systemone=_to_systemone, from_systemone=_completion, error=_chat_error, reply=_stream_if_asked
)
"""``/v1/chat/completions`` onto System One: the schema's decidable properties as questions."""


@router.post(
    "/v1/chat/completions",
    summary="OpenAI structured outputs: a JSON schema's enum/boolean/bounded-integer fields, decided at once",
    response_model=None,
    responses=_RESPONSES,
    description=CHAT_DESCRIPTION,
    openapi_extra=chat_request_body(),
)
async def chat_completions(request: Request) -> Response:
    """Map the request onto System One, answer it, reply with a ``chat.completion`` (or its stream)."""
    return await answer_decision(request, CHAT)


FEATURE = Feature("chat", router, request_models=(ChatCompletionRequest,), error_shaper=openai_shaped_paths)
"""``POST /v1/chat/completions``; OpenAI's error shape for the OpenAI paths and unknown ``/v1/`` paths."""
