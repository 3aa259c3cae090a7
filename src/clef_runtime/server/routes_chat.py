"""``POST /v1/chat/completions``: OpenAI structured outputs answered as one Clef decision.

The mapping lives in :mod:`clef_runtime.protocol.openai_chat`; this route runs it on the System One flow
(auth, limits, batching, state cache, metrics) and renders every error in OpenAI's shape.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.protocol.openai_chat import (
    ChatPlan,
    error_param,
    openai_error_body,
    parse_chat_request,
    to_chat_chunks,
    to_chat_completion,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.server.errors import ApiError, shaped_errors_route, validation_error
from clef_runtime.server.flow import Reply, WireMapping, answer_decision
from clef_runtime.server.openapi_docs import CHAT_DESCRIPTION, chat_request_body

__all__ = ["CHAT", "openai_error_response", "router"]


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
    return JSONResponse(
        openai_error_body(message, error_type, param, code), status_code=status, headers=error.headers
    )


router = APIRouter(route_class=shaped_errors_route(openai_error_response))

_OPENAI_ERROR = {
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


_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "a chat.completion.chunk as JSON, or [DONE] last"},
    },
    "required": ["data"],
}


def _error_doc(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _OPENAI_ERROR}}}


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
    400: _error_doc("Invalid request, undecidable schema property, n > 1, tools, no schema (param names it)"),
    401: _error_doc("Missing or wrong API key (auth on)"),
    413: _error_doc("Body over --max-body-bytes"),
    415: _error_doc("Unsupported Content-Encoding, multipart body, or a form-typed body that is not JSON"),
    429: _error_doc("Queue full; see Retry-After"),
    500: _error_doc("Internal error; the message names the request id"),
    503: _error_doc("Model not loaded yet (or shutting down); see Retry-After"),
}


def _chat_error(exc: RequestValidationError, plan: ChatPlan | None) -> ApiError:
    """``exc`` with System One locations translated to the chat request's fields; an input over the token
    limit becomes OpenAI's 400 ``context_length_exceeded`` naming ``messages``."""
    errors = exc.errors
    if plan is not None:
        errors = [{**err, "loc": translate_error_loc(tuple(err["loc"]), plan)} for err in exc.errors]
    if isinstance(exc, InputTooLongError):
        first = {**errors[0], "type": "context_length_exceeded"}
        return ApiError(400, "invalid_request_error", str(first["msg"]), validation=[first])
    return validation_error(errors)


def _to_systemone(data: Any) -> tuple[dict[str, Any], ChatPlan]:
    return to_systemone(parse_chat_request(data))


def _completion(answer: dict[str, Any], plan: ChatPlan, reply: Reply) -> dict[str, Any]:
    return to_chat_completion(
        answer,
        plan,
        completion_id=f"chatcmpl-{reply.request_id}",
        created=0 if reply.deterministic else int(time.time()),
    )


def _stream_if_asked(response: JSONResponse, plan: ChatPlan) -> Response:
    """With ``stream: true``: the completion's chunks as server-sent events ending with ``[DONE]``."""
    if not plan.stream:
        return response
    completion = json.loads(bytes(response.body))
    events = [
        f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n" for chunk in to_chat_chunks(completion, plan)
    ]
    events.append("data: [DONE]\n\n")
    headers = {
        k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")
    }
    return Response("".join(events), media_type="text/event-stream", headers=headers)


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
