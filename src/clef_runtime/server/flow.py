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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from clef_runtime.engine.contract import PreparedItem
from clef_runtime.engine.decision import Decision
from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.server.admission import admit_caller
from clef_runtime.server.bodies import read_json_body
from clef_runtime.server.context import context_of
from clef_runtime.server.errors import (
    ERROR_RESPONSES,
    ApiError,
    ClientGone,
    error_body,
    from_protocol_error,
    validation_error,
)
from clef_runtime.server.runtime import question_types, runtime_of
from clef_runtime.server.tracing import phase, record_decision

__all__ = [
    "CACHED_TOKENS_HEADER",
    "HEAD_HEADER",
    "STATE_CACHE_HEADER",
    "STEPS_HEADER",
    "SYSTEMONE",
    "FinishedReply",
    "Loc",
    "Reply",
    "WireMapping",
    "answer_decision",
    "client_gone_response",
    "decision_route_doc",
    "finish",
]

logger = logging.getLogger("clef_runtime.server")

PlanT = TypeVar("PlanT")
Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Reply:
    """What a mapping may need besides the answer to build its body: the request id and whether the server
    is deterministic (identical requests must give identical bytes: no clock in the body)."""

    request_id: str
    deterministic: bool

    def timestamp(self) -> int:
        """Seconds since the epoch, for a body's creation time; 0 in deterministic mode."""
        return 0 if self.deterministic else int(time.time())


@dataclass(frozen=True)
class FinishedReply:
    """A decision's response before it is sent: the route's body with the ``x_`` extras, and its headers."""

    body: dict[str, Any]
    headers: dict[str, str]

    def as_json(self) -> JSONResponse:
        return JSONResponse(self.body, headers=self.headers)


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
    reply: Callable[[FinishedReply, PlanT], Response] | None = None
    """Send the finished body (its ``x_`` extras and headers in place) otherwise than as JSON as it is: in an
    envelope, as a stream."""
    classifier: str = ""
    """The saved classifier whose questions the route asks ("" for none): the answers' metrics label."""


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
        with phase(request, "clef.encode"):
            prepared = await runtime.prepare(body)
        decision = await runtime.decide(prepared, request)
    except ClientGone:
        return client_gone_response(request)
    except RequestValidationError as exc:
        error = _error(exc, mapping, plan)
        context_of(request).error_type = error.error_type
        raise error from None
    settings = runtime.settings
    reply = Reply(context_of(request).request_id, settings.deterministic)
    answer = decision.body(deterministic=settings.deterministic)
    body = mapping.from_systemone(answer, plan[0], reply)
    finished = finish(request, body, prepared, decision, classifier=mapping.classifier)
    return finished.as_json() if mapping.reply is None else mapping.reply(finished, plan[0])


STATE_CACHE_HEADER = "X-Clef-State-Cache"
CACHED_TOKENS_HEADER = "X-Clef-Cached-Tokens"
STEPS_HEADER = "X-Clef-Steps"
HEAD_HEADER = "X-Clef-Head"
QUEUE_TIME_HEADER = "x-queue-time"
INFERENCE_TIME_HEADER = "x-inference-time"
TOTAL_TIME_HEADER = "x-total-time"
COMPUTE_TOKENS_HEADER = "x-compute-tokens"


def _ms(seconds: float) -> str:
    return str(round(seconds * 1000))


def finish(
    request: Request, body: dict[str, Any], prepared: PreparedItem, decision: Decision, classifier: str = ""
) -> FinishedReply:
    """Add the ``x_`` extras to a response body (the engine's decision, composed by `Decision.body` and
    mapped to the route's shape) and return it with the decision's headers.

    ``x_truncated_state_tokens`` is always present; ``x_latency_ms`` (server time from arrival to now) is
    left out in deterministic mode so that identical requests give identical bytes (the ``x-total-time``
    header carries it there); with ``--latency-ms`` it is also the top-level ``latency_ms``. Headers: the
    replica that answered (``X-Clef-Replica``), the state-cache report (``X-Clef-State-Cache``: hit /
    partial / miss, ``X-Clef-Cached-Tokens``), and the request's timing as text-embeddings-inference reports
    it: ``x-queue-time`` (waiting for its first engine step), ``x-inference-time`` (from there to its
    answer), ``x-total-time`` (arrival to response), all in milliseconds, ``x-compute-tokens`` (input
    tokens), ``X-Clef-Steps`` (engine steps it took part in) and ``X-Clef-Head`` (``name@digest12``: the
    head that computed the answers, also the body's ``x_head``). The answers are counted in the metrics
    under ``classifier``, the saved classifier asked ("" for none).
    """
    runtime = runtime_of(request)
    record = prepared.record
    out = dict(body)
    out["x_truncated_state_tokens"] = record.truncated_state_tokens
    if decision.head is not None:
        # Every route's body names the head that computed it (System One's has it from the decision).
        out.setdefault("x_head", decision.head.as_api())
    context = context_of(request)
    total_s = time.perf_counter() - context.started_at
    if not runtime.settings.deterministic:
        out["x_latency_ms"] = round(total_s * 1000, 1)
        if runtime.settings.latency_ms:
            out["latency_ms"] = out["x_latency_ms"]
    types = question_types(prepared)
    runtime.metrics.input_tokens.observe(record.input_tokens)
    runtime.metrics.observe_answers(decision, record.truncated_state_tokens, classifier)
    replica = decision.replica or runtime.replica_id
    state_cache = decision.cache.status
    timings = decision.timings
    context.input_tokens = record.input_tokens
    context.questions = len(types)
    context.truncated_state_tokens = record.truncated_state_tokens
    context.state_cache = state_cache
    context.steps = timings.steps
    runtime.metrics.replica_requests.labels(str(replica), state_cache).inc()
    headers = {
        "X-Clef-Replica": str(replica),
        STATE_CACHE_HEADER: state_cache,
        CACHED_TOKENS_HEADER: str(decision.cache.cached_tokens),
        QUEUE_TIME_HEADER: _ms(timings.queue_s),
        INFERENCE_TIME_HEADER: _ms(timings.compute_s),
        TOTAL_TIME_HEADER: _ms(total_s),
        COMPUTE_TOKENS_HEADER: str(record.input_tokens),
        STEPS_HEADER: str(timings.steps),
    }
    if decision.head is not None:
        headers[HEAD_HEADER] = decision.head.label
        context.head = decision.head.label
    record_decision(request, prepared, decision)
    finished = FinishedReply(out, headers)
    if runtime.settings.log_requests:
        # The body as the JSON response renders it (a stream or an envelope carries the same answers).
        rendered = bytes(finished.as_json().body).decode("utf-8")
        logger.info("request_id=%s response_body=%s", context.request_id, rendered)
    return finished


def client_gone_response(request: Request) -> Response:
    """The response for a client that went away (never delivered; 499 in logs and metrics, as nginx)."""
    context_of(request).error_type = "client_closed_request"
    return JSONResponse(
        error_body("client_closed_request", "the client closed the connection"), status_code=499
    )
