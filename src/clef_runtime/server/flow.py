"""The one flow every decision route runs: auth, body, mapping onto System One, prepare, decide,
client-gone, error translation, finish.

A route is its wire mapping (`WireMapping`): how its body becomes a System One body plus a plan, how the
System One answer goes back through the plan, and where an error found in the mapped body points in the
route's own body. ``/v1/systemone`` maps nothing; ``/v1/decisions`` maps the OpenAI-shaped request. A new
route (another wire format: OpenAI chat completions, Workers AI's envelope) adds a mapping and a three-line
handler; its errors may take its own shape (`WireMapping.error`, and a route class from
`clef_runtime.server.errors.shaped_errors_route`) and its response may be rewrapped (`WireMapping.reply`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.server.errors import ApiError, ClientGone, from_protocol_error, validation_error
from clef_runtime.server.handling import (
    ERROR_RESPONSES,
    admit_caller,
    client_gone_response,
    finish,
    note,
    read_json_body,
    runtime_of,
)

__all__ = ["SYSTEMONE", "Loc", "Reply", "WireMapping", "answer_decision", "decision_route_doc"]

PlanT = TypeVar("PlanT")
Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Reply:
    """What a mapping may need besides the answer to build its body: the request id and whether the server
    is deterministic (identical requests must give identical bytes: no clock in the body)."""

    request_id: str
    deterministic: bool


@dataclass(frozen=True)
class WireMapping(Generic[PlanT]):
    """How one route's wire format maps onto System One."""

    to_systemone: Callable[[Any], tuple[Any, PlanT]]
    """Validate the decoded JSON body and map it: ``(system_one_body, plan)``. Raises
    ``RequestValidationError`` with locations in the route's own body."""
    from_systemone: Callable[[dict[str, Any], PlanT, Reply], dict[str, Any]]
    """Build the route's response body from the engine's System One response and the plan."""
    error_loc: Callable[[Loc, PlanT], Loc] | None = None
    """Point an error found in the mapped System One body at the route's own field (None: as it is)."""
    error: Callable[[RequestValidationError, PlanT | None], ApiError] | None = None
    """Turn a validation error into the route's own error (None: 422 / 413 with `error_loc` applied); the
    plan is None when the body itself was invalid."""
    reply: Callable[[JSONResponse, PlanT], Response] | None = None
    """Rewrap the finished JSON response (its ``x_`` extras and headers in place): an envelope, a stream."""


def _unchanged(data: Any) -> tuple[Any, None]:
    return data, None


def _answer_as_is(answer: dict[str, Any], plan: None, reply: Reply) -> dict[str, Any]:
    return answer


SYSTEMONE: WireMapping[None] = WireMapping(to_systemone=_unchanged, from_systemone=_answer_as_is)
"""``/v1/systemone``: the body is a System One request already."""


HEAD_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    404: {
        **ERROR_RESPONSES[401],
        "description": "`model` names a head unloaded at run time, or pins one (`x_head_digest`) that is not "
        "served (`head_not_loaded`); with --strict-model-names, a name no head has (`model_not_found`)",
    },
    409: {
        **ERROR_RESPONSES[401],
        "description": "The head `model` names has another digest than `x_head_digest` pins (`head_changed`)",
    },
}
"""The errors of a request's head (`clef_runtime.engine.head_records`), on every decision route."""


def decision_route_doc(
    request_body: dict[str, Any], response_model: type, response_description: str, description: str
) -> dict[str, Any]:
    """The OpenAPI keywords of a decision route (``@router.post(path, summary=..., **doc)``): the request
    body (an ``openapi_extra`` from `clef_runtime.server.openapi_docs`: schema and examples), the 200
    response, every error and the operation's description."""
    return {
        "response_model": None,
        "responses": {
            200: {"model": response_model, "description": response_description},
            **ERROR_RESPONSES,
            **HEAD_ERROR_RESPONSES,
        },
        "description": description,
        "openapi_extra": request_body,
    }


def _error(exc: RequestValidationError, mapping: WireMapping[PlanT], plan: tuple[PlanT] | None) -> ApiError:
    if mapping.error is not None:
        return mapping.error(exc, None if plan is None else plan[0])
    if plan is not None and mapping.error_loc is not None and not isinstance(exc, InputTooLongError):
        # Found in the mapped System One request: point at the route's own field instead.
        (mapped_plan,) = plan
        loc = mapping.error_loc
        return validation_error([{**err, "loc": loc(tuple(err["loc"]), mapped_plan)} for err in exc.errors])
    return from_protocol_error(exc)


_READ_THE_BODY: Any = object()
"""`answer_decision`'s default ``data``: read the request's own body."""


async def answer_decision(
    request: Request, mapping: WireMapping[PlanT], *, data: Any = _READ_THE_BODY
) -> Response:
    """Answer one decision request of a route: validate, map, encode (off the event loop), queue for the
    engine, map the decision's System One body back, add the ``x_`` extras and headers.

    ``data`` is the route's body already decoded, for a caller whose HTTP body is an envelope around it (an
    MCP tool call's arguments); by default the request's body is read and decoded here.

    Returns the JSON response (499 when the client went away). Raises `ApiError` (401, 400/413/415 for the
    body, 422/413 for validation, 429, 503) for the error handlers.
    """
    admit_caller(request)
    runtime = runtime_of(request)
    runtime.require_ready()
    plan: tuple[PlanT] | None = None  # boxed: a plan may itself be None
    try:
        if data is _READ_THE_BODY:
            data = await read_json_body(request)
        body, mapped = mapping.to_systemone(data)
        plan = (mapped,)
        prepared = await runtime.prepare(body)
        decision = await runtime.decide(prepared, request)
    except ClientGone:
        return client_gone_response(request)
    except RequestValidationError as exc:
        error = _error(exc, mapping, plan)
        note(request, error_type=error.error_type)
        raise error from None
    settings = runtime.settings
    reply = Reply(getattr(request.state, "request_id", None) or uuid.uuid4().hex, settings.deterministic)
    answer = decision.body(deterministic=settings.deterministic)
    response = finish(request, mapping.from_systemone(answer, plan[0], reply), prepared, decision)
    return response if mapping.reply is None else mapping.reply(response, plan[0])
