"""``POST /v1/decisions``: the OpenAI-shaped decisions API, mapped onto the same engine.

See :mod:`clef_runtime.protocol.decisions` for the field mapping.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from clef_runtime.protocol.decisions import (
    DecisionPlan,
    DecisionResponse,
    parse_decisions_request,
    to_decision_response,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.server.flow import Reply, WireMapping, answer_decision, decision_route_doc
from clef_runtime.server.openapi_docs import DECISIONS_DESCRIPTION, decisions_request_body

__all__ = ["DECISIONS", "router"]

router = APIRouter()


def _to_systemone(data: Any) -> tuple[dict[str, Any], DecisionPlan]:
    return to_systemone(parse_decisions_request(data))


def _from_systemone(answer: dict[str, Any], plan: DecisionPlan, reply: Reply) -> dict[str, Any]:
    return to_decision_response(answer, plan)


DECISIONS: WireMapping[DecisionPlan] = WireMapping(
    to_systemone=_to_systemone, from_systemone=_from_systemone, error_loc=translate_error_loc
)
"""``/v1/decisions`` onto System One: questions by index, ``input`` as the state."""


@router.post(
    "/v1/decisions",
    summary="Answer OpenAI-shaped decision questions (predicate / choice / score)",
    **decision_route_doc(
        decisions_request_body(), DecisionResponse, "Answers in question order", DECISIONS_DESCRIPTION
    ),
)
async def decisions(request: Request) -> Response:
    """Map the request onto System One, answer it with the engine, map the answers back."""
    return await answer_decision(request, DECISIONS)
