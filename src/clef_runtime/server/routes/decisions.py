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
    DecisionsRequest,
    parse_decisions_request,
    to_decision_response,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import Reply, WireMapping, answer_decision, decision_route_doc
from clef_runtime.server.openapi import PHOTO_MESSAGE_INPUT, SUPPORT_TICKET, request_body_doc

__all__ = ["DECISIONS", "FEATURE", "router"]

DECISIONS_DESCRIPTION = """\
The same decisions in an OpenAI-shaped form: `input` (a string or input items), and `questions` as an
ordered array of `predicate` / `choice` / `score` questions with an optional `name`. Answers come back as an
array in question order: `predicate` -> `probability`, `choice` -> `choice`, `confidence` and
`probabilities` per value (booleans and numbers are echoed typed), `score` -> `score`, `confidence` and
`probabilities` per level.

Images: `input_image` parts (inline `data:` URLs) in a user message of `input`, at most 4; they are not
allowed in `instructions` (422).
"""

DECISIONS_EXAMPLES: dict[str, dict[str, Any]] = {
    "text": {
        "summary": "Text input, one question of each type",
        "value": {
            "model": "clef-flash",
            "input": SUPPORT_TICKET,
            "questions": [
                {"type": "predicate", "name": "refund", "instructions": "The customer asks for a refund."},
                {
                    "type": "choice",
                    "name": "topic",
                    "instructions": "What is the ticket about?",
                    "choices": [
                        {"value": "billing", "description": "Charges and refunds"},
                        {"value": "shipping"},
                    ],
                },
                {
                    "type": "score",
                    "name": "urgency",
                    "instructions": "How urgent is it?",
                    "levels": [{"label": "low"}, {"label": "medium"}, {"label": "high"}],
                },
            ],
        },
    },
    "image": {
        "summary": "An image part in a user message",
        "value": {
            "model": "clef-flash",
            "input": PHOTO_MESSAGE_INPUT,
            "questions": [{"type": "predicate", "name": "damaged", "instructions": "The item is damaged."}],
        },
    },
}


def decisions_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/decisions``: its body schema and examples."""
    return request_body_doc("DecisionsRequest", "An OpenAI-shaped decisions request.", DECISIONS_EXAMPLES)


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


FEATURE = Feature("decisions", router, request_models=(DecisionsRequest,))
"""``POST /v1/decisions``."""
