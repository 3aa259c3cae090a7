"""``POST /v1/systemone``: the System One API."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from clef_runtime.protocol.systemone import SystemOneRequest, SystemOneResponse
from clef_runtime.server.feature import Feature
from clef_runtime.server.flow import SYSTEMONE, answer_decision, decision_route_doc
from clef_runtime.server.openapi import (
    PNG_BASE64,
    PNG_DATA_URL,
    SUPPORT_TICKET,
    TICKET_QUESTIONS,
    request_body_doc,
)

__all__ = ["FEATURE", "router"]

IMAGES_DESCRIPTION = """\
**Images** (optional, at most 4 per request, PNG / JPEG / WebP, 4 MiB each and 8 MiB together; only inline
`data:` URLs: a remote URL is refused and never fetched) can be sent in either of two places:

- a top-level **`images`** array (Cloudflare's form), each item a data URL string
  (`"data:image/png;base64,iVBOR..."`) or an object `{"content_type": "image/png", "base64": "iVBOR..."}`;
- **image parts inside a `state` array**: `{"type": "image_url", "image_url": {"url": "data:..."}}`
  (OpenRouter) or `{"type": "input_image", "image_url": "data:..."}` (OpenAI). The state is then what remains
  of the array: one remaining string becomes the text state.

The model sees all images in one block before the state (top-level `images` first). A bad image is a 422
whose `loc` names it (`["body", "images", 0]` or `["body", "state", 1]`).
"""

SYSTEMONE_DESCRIPTION = f"""\
Ask typed questions about a **state** (text, JSON and/or images) and get a probability for every option,
from one pass of the model.

Question types (`questions` maps your id to a question; 1 to 64 questions):

- **`noul`** (yes/no): `{{"type": "noul", "instructions": "Is a refund requested?"}}`; optional
  `criteria` `{{"true": "...", "false": "..."}}` describe either side. The answer is `{{"noul": p(true)}}`.
- **`choice`**: `criteria` maps 2 to 255 option ids to a description (or `null`). The answer has `choice`
  (the most probable option), its `confidence` and every option's `probabilities`.
- **`score`**: `criteria` lists 2 to 10 level descriptions, lowest first. The answer has `score` (the
  expected level, sum of level x probability), `confidence` (the largest level probability), `legend` and
  `probabilities` per level.

`instructions` may be a string, an object or an array (absent: the question id is used). Probabilities are
rounded to 4 decimals. The response also carries `x_truncated_state_tokens` (state tokens cut to fit the
input limit) and `x_latency_ms`.

{IMAGES_DESCRIPTION}
Errors: 422 lists every problem with its `loc` (e.g. `["body", "questions", "q1", "criteria"]`); 401 without
a valid key when the server has keys (`Authorization: Bearer <key>` or `X-API-Key`); 413 for a body over the
limit; 429 (queue full) and 503 (model loading) with `Retry-After`.
"""

SYSTEMONE_EXAMPLES: dict[str, dict[str, Any]] = {
    "text": {
        "summary": "Text state, one question of each type",
        "value": {
            "state": SUPPORT_TICKET,
            "questions": TICKET_QUESTIONS,
        },
    },
    "json_state": {
        "summary": "JSON state, noul criteria",
        "value": {
            "model": "jev-latest",
            "state": {"order_id": 1042, "total_eur": 1899.0, "shipping_country": "BR", "new_account": True},
            "questions": {
                "fraud": {
                    "type": "noul",
                    "instructions": "Is this order likely fraudulent?",
                    "criteria": {"true": "Needs a manual review", "false": "Safe to ship"},
                }
            },
        },
    },
    "images": {
        "summary": "Images in the top-level images list",
        "value": {
            "state": "Customer photo of the item they received.",
            "images": [PNG_DATA_URL, {"content_type": "image/png", "base64": PNG_BASE64}],
            "questions": {"damaged": {"type": "noul", "instructions": "Is the item damaged?"}},
        },
    },
    "image_parts": {
        "summary": "Image parts inside a state array",
        "value": {
            "state": [
                "Is this the product from the listing?",
                {"type": "image_url", "image_url": {"url": PNG_DATA_URL}},
            ],
            "questions": {"match": {"type": "noul"}},
        },
    },
}


def systemone_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/systemone``: its body schema, image forms and examples."""
    return request_body_doc(
        "SystemOneRequest",
        "A state, 1 to 64 questions and optional `images` (the image forms are described above).",
        SYSTEMONE_EXAMPLES,
    )


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


FEATURE = Feature("systemone", router, request_models=(SystemOneRequest,))
"""``POST /v1/systemone``."""
