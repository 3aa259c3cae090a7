"""Steps shared by the decision routes: auth, body decoding, response extras, body logging."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from clef_runtime.server.bodies import check_content_type, decode_content, parse_json, read_body
from clef_runtime.server.errors import error_body
from clef_runtime.server.runtime import Prepared, ServerRuntime

__all__ = [
    "CACHED_TOKENS_HEADER",
    "ERROR_RESPONSES",
    "STATE_CACHE_HEADER",
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
    429: _error_doc("Queue full; see Retry-After"),
    500: _error_doc("Internal error; the message names the request id"),
    503: _error_doc("Model not loaded yet (or shutting down); see Retry-After"),
}


def runtime_of(request: Request) -> ServerRuntime:
    """The app's :class:`ServerRuntime`."""
    runtime: ServerRuntime = request.app.state.runtime
    return runtime


def authenticate(request: Request) -> None:
    """Raise :class:`ApiError` 401 unless the request may proceed (always passes with auth off)."""
    runtime_of(request).keys.check(request.headers)


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


def _state_cache_report(out: dict[str, Any], deterministic: bool) -> dict[str, str]:
    """The headers of the engine's state-cache report (``x_state_cache``, ``usage.input_tokens_details.
    cached_tokens``). In deterministic mode the report leaves the body (``x_state_cache`` dropped,
    ``cached_tokens`` 0): a repeated request is served from the cache, and identical requests must give
    identical bytes; the headers still carry it."""
    headers: dict[str, str] = {}
    status = out.get("x_state_cache")
    if isinstance(status, str):
        headers[STATE_CACHE_HEADER] = status
    usage = out.get("usage")
    details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and "cached_tokens" in details:
        headers[CACHED_TOKENS_HEADER] = str(details["cached_tokens"])
    if deterministic:
        out.pop("x_state_cache", None)
        if isinstance(details, dict) and "cached_tokens" in details:
            out["usage"] = {**usage, "input_tokens_details": {**details, "cached_tokens": 0}}  # type: ignore[dict-item]
    return headers


def finish(
    request: Request, body: dict[str, Any], prepared: Prepared, answer: dict[str, Any] | None = None
) -> JSONResponse:
    """Add the ``x_`` extras to a response body and return it as JSON.

    ``answer`` is the engine's System One response when ``body`` was mapped from it (another route's
    shape): its ``x_replica`` / ``x_state_cache`` give the ``X-Clef-Replica`` / ``X-Clef-State-Cache``
    headers.
    ``x_truncated_state_tokens`` is always present; ``x_latency_ms`` (server time from arrival to now) is
    left out in deterministic mode so that identical requests give identical bytes (the ``x-latency-ms``
    header carries it there); with ``--latency-ms`` it is also the top-level ``latency_ms``. The engine's
    state-cache report (``x_state_cache``: hit / partial / miss, and ``usage.input_tokens_details.
    cached_tokens``) is also sent as the ``X-Clef-State-Cache`` and ``X-Clef-Cached-Tokens`` headers (only
    there in deterministic mode).
    """
    runtime = runtime_of(request)
    out = dict(body)
    out["x_truncated_state_tokens"] = prepared.truncated_state_tokens
    if not runtime.settings.deterministic:
        started = getattr(request.state, "started_at", time.perf_counter())
        out["x_latency_ms"] = round((time.perf_counter() - started) * 1000, 1)
        if runtime.settings.latency_ms:
            out["latency_ms"] = out["x_latency_ms"]
    cache_headers = _state_cache_report(out, runtime.settings.deterministic)
    if answer is not None and answer is not body:
        # A mapped route: the report is in the engine's System One answer, not in the route's body.
        cache_headers = _state_cache_report(dict(answer), deterministic=False)
    types = prepared.question_types
    for kind in types:
        runtime.metrics.questions.labels(kind).inc()
    runtime.metrics.input_tokens.observe(prepared.input_tokens)
    if prepared.truncated_state_tokens:
        runtime.metrics.truncated.inc()
    note(
        request,
        input_tokens=prepared.input_tokens,
        questions=len(types),
        truncated_state_tokens=prepared.truncated_state_tokens,
    )
    source = out if answer is None else answer
    replica = source.get("x_replica") or runtime.replica_id
    out.pop("x_replica", None)
    headers = {"X-Clef-Replica": str(replica), **cache_headers}
    state_cache = cache_headers.get(STATE_CACHE_HEADER)
    if state_cache is not None:
        note(request, state_cache=state_cache)
    runtime.metrics.replica_requests.labels(str(replica), state_cache or "unknown").inc()
    response = JSONResponse(out, headers=headers)
    if runtime.settings.log_requests:
        logger.info("request_id=%s response_body=%s", request.state.request_id, response.body.decode("utf-8"))
    return response


def client_gone_response(request: Request) -> Response:
    """The response for a client that went away (never delivered; 499 in logs and metrics, as nginx)."""
    note(request, error_type="client_closed_request")
    return JSONResponse(
        error_body("client_closed_request", "the client closed the connection"), status_code=499
    )
