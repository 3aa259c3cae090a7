"""What the chat completions and Responses routes share: one wire mapping built from a protocol module's
parts (OpenAI's error shape, a stream when the request asks for one) and the documentation of their replies.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter
from fastapi.responses import Response

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.server.errors import ApiError, shaped_errors_route
from clef_runtime.server.flow import FinishedReply, Loc, Reply, WireMapping
from clef_runtime.server.openai.errors import (
    OPENAI_ERROR_RESPONSES,
    openai_error_doc,
    openai_error_response,
    openai_validation_error,
)

__all__ = [
    "StreamablePlan",
    "event_stream",
    "openai_mapping",
    "openai_responses_doc",
    "openai_router",
    "sse_event_doc",
]


class StreamablePlan(Protocol):
    """A mapped OpenAI request's plan: whether its reply is a stream."""

    @property
    def stream(self) -> bool: ...


PlanT = TypeVar("PlanT", bound=StreamablePlan)


def openai_mapping(
    read: Callable[[Any], tuple[dict[str, Any], PlanT]],
    route_loc: Callable[[Loc, PlanT], Loc],
    respond: Callable[[dict[str, Any], PlanT, Reply], dict[str, Any]],
    stream: Callable[[FinishedReply, PlanT], Response],
) -> WireMapping[PlanT]:
    """An OpenAI route onto System One: ``read`` parses and maps the body, ``route_loc`` points an error of
    the mapped body at the route's own field, ``respond`` builds the reply's body, ``stream`` sends it as
    server-sent events when the request says ``stream: true`` (the decision is finished before the first
    event, so errors stay JSON). Every error is in OpenAI's shape."""

    def error(exc: RequestValidationError, plan: PlanT | None) -> ApiError:
        if plan is None:  # the route's body itself was invalid
            return openai_validation_error(exc, None)
        mapped = plan
        return openai_validation_error(exc, lambda loc: route_loc(loc, mapped))

    def reply(finished: FinishedReply, plan: PlanT) -> Response:
        return stream(finished, plan) if plan.stream else finished.as_json()

    return WireMapping(to_systemone=read, from_systemone=respond, error=error, reply=reply)


def event_stream(
    events: Iterable[Mapping[str, Any]], headers: Mapping[str, str], *, named: bool, done: bool
) -> Response:
    """One ``text/event-stream`` response of ``events``, each a ``data:`` line of its JSON (after an
    ``event: <type>`` line when ``named``: the Responses stream), ending with ``data: [DONE]`` when ``done``
    (chat completions)."""
    parts = [
        (f"event: {event['type']}\n" if named else "") + f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        for event in events
    ]
    if done:
        parts.append("data: [DONE]\n\n")
    return Response("".join(parts), media_type="text/event-stream", headers=dict(headers))


def openai_router() -> APIRouter:
    """A router whose every error, validation and HTTP errors included, is in OpenAI's shape."""
    return APIRouter(route_class=shaped_errors_route(openai_error_response))


def sse_event_doc(data: str, event: str | None) -> dict[str, Any]:
    """The schema of one server-sent event: its ``data`` (described), and its ``event`` line (described and
    required when the stream names its events)."""
    event_doc: dict[str, Any] = {"type": "string"}
    if event is not None:
        event_doc["description"] = event
    required = ["data"] if event is None else ["event", "data"]
    properties = {"event": event_doc, "data": {"type": "string", "description": data}}
    return {"type": "object", "properties": properties, "required": required}


def openai_responses_doc(
    ok: str, json_content: dict[str, Any], sse_event: dict[str, Any], bad_request: str
) -> dict[int | str, dict[str, Any]]:
    """The documented responses of an OpenAI route: its 200 (``ok``) as JSON or as server-sent events (one
    schema per event, as OpenAPI tools read an event stream), its 400 (``bad_request``) and the errors every
    OpenAI route shares."""
    return {
        200: {
            "description": ok,
            "content": {"application/json": json_content, "text/event-stream": {"schema": sse_event}},
        },
        400: openai_error_doc(bad_request),
        **OPENAI_ERROR_RESPONSES,
    }
