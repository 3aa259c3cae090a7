"""``POST /v1/systemone``: the System One API."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from clef_runtime.protocol.systemone import SystemOneResponse
from clef_runtime.server.flow import SYSTEMONE, answer_decision, decision_route_doc
from clef_runtime.server.openapi_docs import SYSTEMONE_DESCRIPTION, systemone_request_body

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/v1/systemone",
    summary="Answer System One questions about a state",
    **decision_route_doc(
        systemone_request_body(), SystemOneResponse, "One answer per question id", SYSTEMONE_DESCRIPTION
    ),
)
async def systemone(request: Request) -> Response:
    """Validate, encode (off the event loop), queue for the engine, answer.

    Top-level extras: ``x_truncated_state_tokens`` (state tokens cut to fit) and ``x_latency_ms``.
    """
    return await answer_decision(request, SYSTEMONE)
