"""What /docs and /redoc show for the OpenAI routes: descriptions and request examples of chat completions and
Responses (one triage schema serves both), and a Responses reply."""

from __future__ import annotations

from typing import Any

from clef_runtime.server.openapi import PHOTO_MESSAGE_INPUT, SUPPORT_TICKET, request_body_doc

CHAT_DESCRIPTION = """\
OpenAI structured outputs, answered by one Clef decision instead of generated text. The conversation
(`messages`) is the state; each property of `response_format.json_schema.schema` that is decidable becomes a
question: a string `enum` (or `anyOf` of `const`s) a choice, a `boolean` a yes/no, an `integer` with
`minimum`/`maximum` (2 to 10 levels) a score. The reply is a `chat.completion` whose message content is the
JSON object of the most probable answers, with per-token `logprobs` when asked and the System One answers in
`x_decisions`. A function tool (in `tools`, forced by `tool_choice` or the only one) is decided the same way
from its `parameters`, and the reply is one call of it (`message.tool_calls`, `finish_reason: "tool_calls"`);
assistant `tool_calls` and `role: "tool"` messages in the history are part of the state. `stream: true`
sends the same completion as server-sent events. The extension `x_explain` (`true` or `{"top_k",
"granularity"}`) gives each answer in `x_decisions` its `x_evidence`, with the body's `x_explain` record
beside it. Errors use OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`, `param` naming the
field).
"""

TRIAGE_SCHEMA = {
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
                {"role": "user", "content": SUPPORT_TICKET},
            ],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "triage", "schema": TRIAGE_SCHEMA, "strict": True},
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
            "messages": [{"role": "user", "content": SUPPORT_TICKET}],
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "triage", "parameters": TRIAGE_SCHEMA, "strict": True},
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "triage"}},
            "parallel_tool_calls": False,
        },
    },
}


def chat_request_body() -> dict[str, Any]:
    """The ``openapi_extra`` of ``POST /v1/chat/completions``: its body schema and examples."""
    return request_body_doc(
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
The extension `x_explain` (`true` or `{"top_k", "granularity"}`) gives each answer in `x_decisions` its
`x_evidence`, with the body's `x_explain` record beside it.
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
            "input": SUPPORT_TICKET,
            "text": {
                "format": {"type": "json_schema", "name": "triage", "schema": TRIAGE_SCHEMA, "strict": True}
            },
            "include": ["message.output_text.logprobs"],
        },
    },
    "function_tool": {
        "summary": "The schema as a forced function tool, after an earlier call in the history",
        "value": {
            "model": "clef-flash",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": SUPPORT_TICKET}]},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "lookup_order",
                    "arguments": '{"order": 1042}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "order 1042: charged twice"},
            ],
            "tools": [{"type": "function", "name": "triage", "parameters": TRIAGE_SCHEMA, "strict": True}],
            "tool_choice": {"type": "function", "name": "triage"},
        },
    },
    "image": {
        "summary": "An input_image part (an inline data: URL) in a user message",
        "value": {
            "model": "clef-flash",
            "input": PHOTO_MESSAGE_INPUT,
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
    "text": {"format": {"type": "json_schema", "name": "triage", "schema": TRIAGE_SCHEMA, "strict": True}},
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
    return request_body_doc(
        "ResponsesRequest",
        "An OpenAI Responses API request with a JSON schema or a function tool.",
        RESPONSES_EXAMPLES,
    )
