"""What /docs and /redoc show a person: request examples for the decision routes, response examples for
the operational ones, and descriptions written for users (the route functions' docstrings are for us).

Only documentation lives here; the schemas themselves come from the protocol models. Every request example
is sent to a server by tests/server/test_openapi_docs.py, so none can drift from what the server accepts.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CLASSIFIERS_AND_MCP_DESCRIPTION",
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

CLASSIFIERS_AND_MCP_DESCRIPTION = """\
**Saved classifiers** (`/v1/classifiers`): save a set of System One questions (and the head that answers
them) once under a name with `PUT /v1/classifiers/{name}`, then send only a state to
`POST /v1/classifiers/{name}/decide`, which answers what `POST /v1/systemone` answers for the saved questions.
Each API key sees only its own classifiers. More: the README's "Saved classifiers" and `docs/classifiers.md`.

**MCP** (`POST /mcp`, not listed below): the Model Context Protocol's Streamable HTTP transport, so that an
agent can use the model as a tool: `decide` takes a System One request, and each saved classifier is a tool
`classify_<name>`. The same keys and rate limits apply. More: the README's "MCP" (`clef mcp` serves `decide`
over stdio, for desktop agents).
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
`x_decisions`. A function tool (in `tools`, forced by `tool_choice` or the only one) is decided the same way
from its `parameters`, and the reply is one call of it (`message.tool_calls`, `finish_reason: "tool_calls"`);
assistant `tool_calls` and `role: "tool"` messages in the history are part of the state. `stream: true`
sends the same completion as server-sent events. Errors use OpenAI's shape
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
    "function_tool": {
        "summary": "The schema as a forced function tool (instructor's and LangChain's function calling)",
        "value": {
            "model": "clef-flash",
            "messages": [{"role": "user", "content": _SUPPORT_TICKET}],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "triage", "parameters": _TRIAGE_SCHEMA, "strict": True},
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "triage"}},
            "parallel_tool_calls": False,
        },
    },
}


def chat_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/chat/completions``: its body schema and examples."""
    return _request_body(
        "ChatCompletionRequest", "An OpenAI chat completion request with a JSON schema.", CHAT_EXAMPLES
    )


RESPONSES_DESCRIPTION = """\
OpenAI's Responses API, answered by one Clef decision instead of generated text (what
`client.responses.parse(text_format=Model)` and `responses.create` send). `instructions` (a leading system
message) and `input` (a string, or message, `function_call` and `function_call_output` items) are the state;
each property of `text.format` (`{"type": "json_schema", "name", "schema"}`) is one question, mapped as on
`/v1/chat/completions`: a string `enum` (or `anyOf` of `const`s) a choice, a `boolean` a yes/no, an `integer`
with `minimum`/`maximum` (2 to 10 levels) a score. A function tool (`{"type": "function", "name",
"parameters"}`, forced by `tool_choice` or the only one; with a `text.format` schema too, only when named or
"required") is decided from its `parameters`. The reply is a Response object whose `output` is one
`message` (its `output_text` the JSON object of the most probable answers, with per-field `logprobs` when
`include` has `message.output_text.logprobs`) or one `function_call`, with the System One answers in
`x_decisions`. `stream: true` answers with the Responses event stream (the decision is made first; the text
or the call's arguments come in one delta, then `response.completed` with usage).
Refused with 400 naming the field: `previous_response_id`, `conversation` and `prompt`
(nothing is stored), `background: true`, a `text` / `json_object` format without a tool. Errors use OpenAI's
shape (`{"error": {"message", "type", "param", "code"}}`).
"""

RESPONSES_EXAMPLES: dict[str, dict[str, Any]] = {
    "json_schema": {
        "summary": "Route a support ticket (what responses.parse(text_format=Model) sends)",
        "value": {
            "model": "clef-flash",
            "instructions": "You triage support tickets.",
            "input": _SUPPORT_TICKET,
            "text": {
                "format": {"type": "json_schema", "name": "triage", "schema": _TRIAGE_SCHEMA, "strict": True}
            },
            "include": ["message.output_text.logprobs"],
        },
    },
    "function_tool": {
        "summary": "The schema as a forced function tool, after an earlier call in the history",
        "value": {
            "model": "clef-flash",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": _SUPPORT_TICKET}]},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "lookup_order",
                    "arguments": '{"order": 1042}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "order 1042: charged twice"},
            ],
            "tools": [{"type": "function", "name": "triage", "parameters": _TRIAGE_SCHEMA, "strict": True}],
            "tool_choice": {"type": "function", "name": "triage"},
        },
    },
    "image": {
        "summary": "An input_image part (an inline data: URL) in a user message",
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
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "damage",
                    "schema": {
                        "type": "object",
                        "properties": {"damaged": {"type": "boolean", "description": "Is the item damaged?"}},
                        "required": ["damaged"],
                    },
                }
            },
        },
    },
}

RESPONSES_REPLY_EXAMPLE: dict[str, Any] = {
    "id": "resp_4f1c2a",
    "object": "response",
    "created_at": 1767225600,
    "completed_at": 1767225600,
    "status": "completed",
    "error": None,
    "incomplete_details": None,
    "model": "clef-flash",
    "output": [
        {
            "type": "message",
            "id": "msg_4f1c2a",
            "role": "assistant",
            "status": "completed",
            "content": [
                {
                    "type": "output_text",
                    "text": '{"team": "billing", "urgent": true, "priority": 3}',
                    "annotations": [],
                    "logprobs": [],
                }
            ],
        }
    ],
    "previous_response_id": None,
    "store": False,
    "instructions": "You triage support tickets.",
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "temperature": None,
    "text": {"format": {"type": "json_schema", "name": "triage", "schema": _TRIAGE_SCHEMA, "strict": True}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
    "user": None,
    "usage": {
        "input_tokens": 96,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 96,
    },
    "x_decisions": {
        "team": {
            "type": "choice",
            "choice": "billing",
            "confidence": 0.91,
            "probabilities": {"billing": 0.91, "tech": 0.06, "sales": 0.03},
        },
        "urgent": {"type": "noul", "noul": 0.83},
        "priority": {
            "type": "score",
            "score": 2.1,
            "confidence": 0.55,
            "legend": {"0": "1", "1": "2", "2": "3", "3": "4"},
            "probabilities": {"0": 0.05, "1": 0.2, "2": 0.55, "3": 0.2},
        },
    },
    "x_truncated_state_tokens": 0,
}


def responses_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/responses``: its body schema and examples."""
    return _request_body(
        "ResponsesRequest",
        "An OpenAI Responses API request with a JSON schema or a function tool.",
        RESPONSES_EXAMPLES,
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
