"""Steps shared by the decision routes: auth, body decoding, response extras, body logging."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from clef_runtime.engine.contract import PreparedItem
from clef_runtime.engine.decision import Decision
from clef_runtime.server.bodies import check_content_type, decode_content, parse_json, read_body
from clef_runtime.server.errors import ApiError, error_body
from clef_runtime.server.runtime import ServerRuntime, question_types

__all__ = [
    "CACHED_TOKENS_HEADER",
    "ERROR_RESPONSES",
    "RATE_LIMIT_HEADERS_STATE",
    "STATE_CACHE_HEADER",
    "STEPS_HEADER",
    "admit_caller",
    "authenticate",
    "client_gone_response",
    "finish",
    "note",
    "read_json_body",
    "runtime_of",
]

logger = logging.getLogger("clef_runtime.server")


def _error_doc(description: str) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {
            "detail": {
                "type": "object",
                "properties": {"error_type": {"type": "string"}, "message": {"type": "string"}},
                "required": ["error_type", "message"],
            }
        },
    }
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_VALIDATION_DOC = {
    "description": "Validation error (also malformed JSON)",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "detail": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "loc": {
                                    "type": "array",
                                    "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                },
                                "msg": {"type": "string"},
                                "type": {"type": "string"},
                            },
                            "required": ["loc", "msg", "type"],
                        },
                    }
                },
            }
        }
    },
}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error_doc("Undecodable body (corrupt compression, bad Content-Length)"),
    401: _error_doc("Missing or wrong API key (auth on)"),
    413: _error_doc("Body over --max-body-bytes, or input over the token limit with --on-overflow reject"),
    415: _error_doc("Unsupported Content-Encoding, multipart body, or a form-typed body that is not JSON"),
    422: _VALIDATION_DOC,
    429: _error_doc("Queue full, or over this caller's --rate-limit; see Retry-After"),
    500: _error_doc("Internal error; the message names the request id"),
    503: _error_doc(
        "Model not loaded yet, shutting down, or waited past --queue-timeout-ms without starting; "
        "see Retry-After"
    ),
}


def runtime_of(request: Request) -> ServerRuntime:
    """The app's :class:`ServerRuntime`."""
    runtime: ServerRuntime = request.app.state.runtime
    return runtime


def authenticate(request: Request) -> None:
    """Raise :class:`ApiError` 401 unless the request may proceed (always passes with auth off)."""
    name = runtime_of(request).keys.check(request.headers)
    if name is not None:
        note(request, key=name)


RATE_LIMIT_HEADERS_STATE = "rate_limit_headers"
"""Where `admit_caller` leaves the caller's ``X-RateLimit-*`` headers for the response (request state)."""
ANONYMOUS_CALLER = "anonymous"


def admit_caller(request: Request) -> None:
    """Authenticate the request and take one request from its caller's rate limit (a decision route's
    first step). The caller is its key's name, or its client address with auth off. The ``X-RateLimit-*``
    headers go on the response, whatever its status.

    Raises :class:`ApiError` 401 (auth) or 429 ``rate_limited`` with Retry-After."""
    runtime = runtime_of(request)
    name = runtime.keys.check(request.headers)
    if name is not None:
        note(request, key=name)  # the request log line's key=NAME (the key itself is never logged)
    limiter = runtime.limiter
    if limiter is None:
        return
    address = request.client.host if request.client is not None else ""
    decision = limiter.take(name if name is not None else f"address:{address}")
    headers = decision.headers()
    # Metric labels are key names (bounded by the configuration); client addresses are not.
    label = name or ANONYMOUS_CALLER
    runtime.metrics.caller_requests.labels(label, "admitted" if decision.allowed else "rate_limited").inc()
    if not decision.allowed:
        runtime.metrics.rejected.labels("rate_limited").inc()
        note(request, caller=label)
        raise ApiError(
            429,
            "rate_limited",
            f"over the rate limit of {limiter.describe()} for "
            f"{'key ' + repr(name) if name else 'this client address'}; retry in {headers['Retry-After']} s",
            headers=headers,
        )
    setattr(request.state, RATE_LIMIT_HEADERS_STATE, headers)


async def read_json_body(request: Request) -> Any:
    """Read, decompress and parse the JSON body within the configured limits.

    Returns the decoded JSON value. Raises :class:`ApiError` (400/413/415/422) or
    :class:`ClientGone` when the client disconnects mid-body.
    """
    runtime = runtime_of(request)
    limit = runtime.settings.max_body_bytes
    content_type = request.headers.get("content-type")
    check_content_type(content_type)
    raw = await read_body(request, limit)
    encoding = request.headers.get("content-encoding")

    def decode() -> Any:
        return parse_json(decode_content(raw, encoding, limit), content_type)

    # Decompression and parsing of a multi-megabyte body take milliseconds: keep them off the event loop.
    data = await anyio.to_thread.run_sync(decode)
    if runtime.settings.log_requests:
        logger.info(
            "request_id=%s request_body=%s",
            request.state.request_id,
            json.dumps(data, ensure_ascii=False, separators=(",", ":")),
        )
    return data


def note(request: Request, **fields: Any) -> None:
    """Attach fields to the request's log line."""
    for key, value in fields.items():
        setattr(request.state, key, value)


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
    request: Request, body: dict[str, Any], prepared: PreparedItem, decision: Decision
) -> JSONResponse:
    """Add the ``x_`` extras to a response body (the engine's decision, composed by `Decision.body` and
    mapped to the route's shape) and return it as JSON with the decision's headers.

    ``x_truncated_state_tokens`` is always present; ``x_latency_ms`` (server time from arrival to now) is
    left out in deterministic mode so that identical requests give identical bytes (the ``x-total-time``
    header carries it there); with ``--latency-ms`` it is also the top-level ``latency_ms``. Headers: the
    replica that answered (``X-Clef-Replica``), the state-cache report (``X-Clef-State-Cache``: hit /
    partial / miss, ``X-Clef-Cached-Tokens``), and the request's timing as text-embeddings-inference reports
    it: ``x-queue-time`` (waiting for its first engine step), ``x-inference-time`` (from there to its
    answer), ``x-total-time`` (arrival to response), all in milliseconds, ``x-compute-tokens`` (input
    tokens), ``X-Clef-Steps`` (engine steps it took part in) and ``X-Clef-Head`` (``name@digest12``: the
    head that computed the answers, also the body's ``x_head``).
    """
    runtime = runtime_of(request)
    record = prepared.record
    out = dict(body)
    out["x_truncated_state_tokens"] = record.truncated_state_tokens
    if decision.head is not None:
        # Every route's body names the head that computed it (System One's has it from the decision).
        out.setdefault("x_head", decision.head.as_api())
    started = getattr(request.state, "started_at", time.perf_counter())
    total_s = time.perf_counter() - started
    if not runtime.settings.deterministic:
        out["x_latency_ms"] = round(total_s * 1000, 1)
        if runtime.settings.latency_ms:
            out["latency_ms"] = out["x_latency_ms"]
    types = question_types(prepared)
    for kind in types:
        runtime.metrics.questions.labels(kind).inc()
    runtime.metrics.input_tokens.observe(record.input_tokens)
    if record.truncated_state_tokens:
        runtime.metrics.truncated.inc()
    replica = decision.replica or runtime.replica_id
    state_cache = decision.cache.status
    timings = decision.timings
    note(
        request,
        input_tokens=record.input_tokens,
        questions=len(types),
        truncated_state_tokens=record.truncated_state_tokens,
        state_cache=state_cache,
        steps=timings.steps,
    )
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
        note(request, head=decision.head.label)
    response = JSONResponse(out, headers=headers)
    if runtime.settings.log_requests:
        logger.info(
            "request_id=%s response_body=%s", request.state.request_id, bytes(response.body).decode("utf-8")
        )
    return response


def client_gone_response(request: Request) -> Response:
    """The response for a client that went away (never delivered; 499 in logs and metrics, as nginx)."""
    note(request, error_type="client_closed_request")
    return JSONResponse(
        error_body("client_closed_request", "the client closed the connection"), status_code=499
    )
