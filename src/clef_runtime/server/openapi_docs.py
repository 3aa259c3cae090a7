"""What /docs and /redoc show a person: request examples for the decision routes, response examples for
the operational ones, and descriptions written for users (the route functions' docstrings are for us).

Only documentation lives here; the schemas themselves come from the protocol models. Every request example
is sent to a server by tests/server/test_openapi_docs.py, so none can drift from what the server accepts.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DECISIONS_DESCRIPTION",
    "SYSTEMONE_DESCRIPTION",
    "decisions_request_body",
    "json_example",
    "systemone_request_body",
]

# A 1x1 transparent PNG: the smallest image the server accepts, for the examples.
_PNG_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)
_PNG_DATA_URL = "data:image/png;base64," + _PNG_BASE64

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

DECISIONS_DESCRIPTION = """\
The same decisions in an OpenAI-shaped form: `input` (a string or input items), and `questions` as an
ordered array of `predicate` / `choice` / `score` questions with an optional `name`. Answers come back as an
array in question order: `predicate` -> `probability`, `choice` -> `choice`, `confidence` and
`probabilities` per value (booleans and numbers are echoed typed), `score` -> `score`, `confidence` and
`probabilities` per level.

Images: `input_image` parts (inline `data:` URLs) in a user message of `input`, at most 4; they are not
allowed in `instructions` (422).
"""

_SUPPORT_TICKET = "I was charged twice for order #1042 and it still has not arrived. Please refund me."

SYSTEMONE_EXAMPLES: dict[str, dict[str, Any]] = {
    "text": {
        "summary": "Text state, one question of each type",
        "value": {
            "state": _SUPPORT_TICKET,
            "questions": {
                "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
                "topic": {
                    "type": "choice",
                    "instructions": "What is the ticket mainly about?",
                    "criteria": {"billing": "Charges and refunds", "shipping": "Delivery", "other": None},
                },
                "urgency": {
                    "type": "score",
                    "instructions": "How urgent is it?",
                    "criteria": ["Can wait", "Today", "Now"],
                },
            },
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
            "images": [_PNG_DATA_URL, {"content_type": "image/png", "base64": _PNG_BASE64}],
            "questions": {"damaged": {"type": "noul", "instructions": "Is the item damaged?"}},
        },
    },
    "image_parts": {
        "summary": "Image parts inside a state array",
        "value": {
            "state": [
                "Is this the product from the listing?",
                {"type": "image_url", "image_url": {"url": _PNG_DATA_URL}},
            ],
            "questions": {"match": {"type": "noul"}},
        },
    },
}

DECISIONS_EXAMPLES: dict[str, dict[str, Any]] = {
    "text": {
        "summary": "Text input, one question of each type",
        "value": {
            "model": "clef-flash",
            "input": _SUPPORT_TICKET,
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
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Customer photo of the item they received."},
                        {"type": "input_image", "image_url": _PNG_DATA_URL},
                    ],
                }
            ],
            "questions": [{"type": "predicate", "name": "damaged", "instructions": "The item is damaged."}],
        },
    },
}


def _request_body(schema: str, description: str, examples: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "description": description,
            "content": {
                "application/json": {
                    "schema": {"$ref": f"#/components/schemas/{schema}"},
                    "examples": examples,
                }
            },
        }
    }


def systemone_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/systemone``: its body schema, image forms and examples."""
    return _request_body(
        "SystemOneRequest",
        "A state, 1 to 64 questions and optional `images` (the image forms are described above).",
        SYSTEMONE_EXAMPLES,
    )


def decisions_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/decisions``: its body schema and examples."""
    return _request_body("DecisionsRequest", "An OpenAI-shaped decisions request.", DECISIONS_EXAMPLES)


def json_example(description: str, example: Any) -> dict[str, Any]:
    """A ``responses`` entry documenting a JSON 200 with one example."""
    return {"description": description, "content": {"application/json": {"example": example}}}


CHAT_DESCRIPTION = """\
OpenAI structured outputs, answered by one Clef decision instead of generated text. The conversation
(`messages`) is the state; each property of `response_format.json_schema.schema` that is decidable becomes a
question: a string `enum` (or `anyOf` of `const`s) a choice, a `boolean` a yes/no, an `integer` with
`minimum`/`maximum` (2 to 10 levels) a score. The reply is a `chat.completion` whose message content is the
JSON object of the most probable answers, with per-token `logprobs` when asked and the System One answers in
`x_decisions`. `stream: true` sends the same completion as server-sent events. Errors use OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`, `param` naming the field).
"""

_TRIAGE_SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"type": "string", "enum": ["billing", "tech", "sales"], "description": "Which team?"},
        "urgent": {"type": "boolean", "description": "Does it need a reply within the hour?"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 4, "description": "1 low, 4 critical"},
    },
    "required": ["team", "urgent", "priority"],
    "additionalProperties": False,
}

CHAT_EXAMPLES: dict[str, dict[str, Any]] = {
    "triage": {
        "summary": "Route a support ticket (choice, yes/no and a 1-4 level at once)",
        "value": {
            "model": "clef-flash",
            "messages": [
                {"role": "system", "content": "You triage support tickets."},
                {"role": "user", "content": _SUPPORT_TICKET},
            ],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "triage", "schema": _TRIAGE_SCHEMA, "strict": True},
            },
        },
    },
    "stream_with_logprobs": {
        "summary": "One yes/no property, streamed, with the log-probabilities of both answers",
        "value": {
            "model": "clef-flash",
            "messages": [{"role": "user", "content": "Great product, but the box arrived crushed."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "damage",
                    "schema": {
                        "type": "object",
                        "properties": {"damaged": {"type": "boolean", "description": "Is the item damaged?"}},
                        "required": ["damaged"],
                    },
                },
            },
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
        },
    },
}


def chat_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/chat/completions``: its body schema and examples."""
    return _request_body(
        "ChatCompletionRequest", "An OpenAI chat completion request with a JSON schema.", CHAT_EXAMPLES
    )


WORKERS_AI_DESCRIPTION = """\
Workers AI's REST route for Clef, so that code written against
`https://api.cloudflare.com/client/v4/accounts/{account_id}/ai/run/@cf/cloudflare/clef-flash` runs against
this server by changing the base URL. Any account id is accepted; the model path is
`@cf/cloudflare/clef-flash`
(or `@cf/cloudflare/clef`). The body is a System One request, the answer is its System One response in
Cloudflare's envelope (`{"result", "success", "errors", "messages"}`), and errors are in the same envelope
with Cloudflare's codes.
"""

WORKERS_AI_EXAMPLES: dict[str, dict[str, Any]] = {
    name: {**example, "summary": f"{example['summary']} (in Workers AI's envelope)"}
    for name, example in SYSTEMONE_EXAMPLES.items()
    if name in ("text", "json_state")
}


def workers_ai_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of Workers AI's route: the System One body schema and examples."""
    return _request_body("SystemOneRequest", "A System One request.", WORKERS_AI_EXAMPLES)
