"""``POST /v1/chat/completions``: OpenAI structured outputs answered as one Clef decision.

The mapping lives in :mod:`clef_runtime.protocol.openai_chat`; this route runs it on the System One flow
(auth, limits, batching, state cache, metrics) and renders every error in OpenAI's shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from clef_runtime.protocol.openai_chat import (
    ChatCompletionRequest,
    ChatPlan,
    parse_chat_request,
    to_chat_chunks,
    to_chat_completion,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import FinishedReply, Reply, WireMapping, answer_decision
from clef_runtime.server.openai.docs import CHAT_DESCRIPTION, chat_request_body
from clef_runtime.server.openai.errors import (
    openai_shaped_paths,
)
from clef_runtime.server.openai.replies import (
    event_stream,
    openai_mapping,
    openai_responses_doc,
    openai_router,
    sse_event_doc,
)

__all__ = ["CHAT", "FEATURE", "router"]

router = openai_router()

_SSE_EVENT = sse_event_doc("a chat.completion.chunk as JSON, or [DONE] last", None)


_RESPONSES = openai_responses_doc(
    "A chat.completion (content = the JSON object of the answers; x_decisions = the System One answers), or "
    "with stream: true its chunks as server-sent events ending with data: [DONE]",
    {"schema": {"type": "object"}},
    # Its data is a chat.completion.chunk in JSON, and the last event's data is the literal [DONE].
    _SSE_EVENT,
    "Invalid request, undecidable schema property, n > 1, several tools and none named, no schema "
    "(param names it)",
)


def _completion(answer: dict[str, Any], plan: ChatPlan, reply: Reply) -> dict[str, Any]:
    completion_id = f"chatcmpl-{reply.request_id}"
    return to_chat_completion(answer, plan, completion_id=completion_id, created=reply.timestamp())


def _chunks(finished: FinishedReply, plan: ChatPlan) -> Response:
    """The completion's chunks as server-sent events ending with ``[DONE]``."""
    return event_stream(to_chat_chunks(finished.body, plan), finished.headers, named=False, done=True)


CHAT: WireMapping[ChatPlan] = openai_mapping(
    lambda data: to_systemone(parse_chat_request(data)), translate_error_loc, _completion, _chunks
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
