"""The Chat Completions mapping: JSON schema -> System One questions, messages -> state, answers -> a
chat.completion, and every undecidable shape refused naming its property."""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Any, Literal

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.openai_chat import (
    SCHEMA_LOC,
    ChatPlan,
    parse_chat_request,
    schema_questions,
    to_chat_chunks,
    to_chat_completion,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.protocol.systemone import parse_request
from tests.protocol.openai_common import ENGINE_REPLY, assert_refused


class Sentiment(Enum):
    """How the customer feels."""

    positive = "positive"
    negative = "negative"
    neutral = "neutral"


class Ticket(BaseModel):
    team: Literal["billing", "tech", "sales"] = Field(description="Which team should handle it?")
    sentiment: Sentiment
    mood: Sentiment = Field(description="The customer's mood")
    urgent: bool
    priority: int = Field(ge=1, le=5, description="How urgent, 1 to 5")
    channel: Literal["mail", "phone"] | None = None


EXPECTED_QUESTIONS = {
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {"billing": None, "tech": None, "sales": None},
    },
    "sentiment": {
        "type": "choice",
        "instructions": "How the customer feels.",
        "criteria": {"positive": None, "negative": None, "neutral": None},
    },
    "mood": {
        "type": "choice",
        "instructions": "The customer's mood",
        "criteria": {"positive": None, "negative": None, "neutral": None},
    },
    "urgent": {"type": "noul", "instructions": "Urgent"},
    "priority": {
        "type": "score",
        "instructions": "How urgent, 1 to 5",
        "criteria": ["1", "2", "3", "4", "5"],
    },
    "channel": {"type": "choice", "instructions": "Channel", "criteria": {"mail": None, "phone": None}},
}


@pytest.mark.parametrize(
    "schema",
    [Ticket.model_json_schema(), to_strict_json_schema(Ticket)],
    ids=["pydantic", "openai-strict"],
)
def test_pydantic_and_openai_strict_schemas_map_to_the_same_questions(schema: dict[str, Any]) -> None:
    questions, fields = schema_questions(schema)
    assert questions == EXPECTED_QUESTIONS
    assert list(questions) == list(EXPECTED_QUESTIONS)  # schema order
    assert [f.kind for f in fields] == ["choice", "choice", "choice", "boolean", "integer", "choice"]
    assert dict(fields[4].values) == {"0": 1, "1": 2, "2": 3, "3": 4, "4": 5}
    parse_request({"state": "x", "questions": questions})  # a valid System One request


def test_ref_wrapped_in_allof_and_const_branches_with_descriptions() -> None:
    schema = {
        "type": "object",
        "$defs": {"Level": {"type": "string", "enum": ["low", "high"], "title": "Level"}},
        "properties": {
            "level": {"allOf": [{"$ref": "#/$defs/Level"}], "description": "How high?"},
            "kind": {
                "oneOf": [
                    {"const": "bug", "description": "something is broken"},
                    {"const": "ask", "title": "a question"},
                    {"const": "other"},
                ],
                "description": "What kind of ticket",
            },
            "code": {"type": "integer", "enum": [200, 404, 500]},
            "stars": {"type": ["integer", "null"], "exclusiveMinimum": 0, "exclusiveMaximum": 4},
            "flag": {"type": "boolean", "description": "Flagged?"},
        },
    }
    questions, fields = schema_questions(schema)
    assert questions["level"] == {
        "type": "choice",
        "instructions": "How high?",
        "criteria": {"low": None, "high": None},
    }
    assert questions["kind"]["criteria"] == {"bug": "something is broken", "ask": "a question", "other": None}
    assert questions["kind"]["instructions"] == "What kind of ticket"
    assert questions["code"]["criteria"] == {"200": None, "404": None, "500": None}
    assert dict(fields[2].values) == {"200": 200, "404": 404, "500": 500}  # integers answered as integers
    assert questions["stars"] == {"type": "score", "criteria": ["1", "2", "3"]}  # no text: the id is used
    assert questions["flag"] == {"type": "noul", "instructions": "Flagged?"}


def test_a_root_ref_is_resolved() -> None:
    schema = {
        "$ref": "#/definitions/T",
        "definitions": {"T": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
    }
    assert schema_questions(schema)[0] == {"ok": {"type": "noul"}}


def _refused(schema: Any) -> dict[str, Any]:
    with pytest.raises(RequestValidationError) as info:
        schema_questions(schema)
    return info.value.errors[0]


@pytest.mark.parametrize(
    ("prop", "words"),
    [
        ({"type": "string"}, "a free string"),
        ({"type": "string", "format": "date"}, "a free string"),
        ({"type": "number", "minimum": 0, "maximum": 1}, "a number"),
        ({"type": "object", "properties": {"a": {"type": "boolean"}}}, "a nested object"),
        ({"type": "array", "items": {"type": "boolean"}}, "an array"),
        ({"type": "integer"}, "without minimum and maximum"),
        ({"type": "integer", "minimum": 0}, "without minimum and maximum"),
        ({"type": "integer", "minimum": 0, "maximum": 10}, "spans 11"),
        ({"type": "integer", "minimum": 3, "maximum": 3}, "spans 1"),
        ({"type": "string", "enum": ["only"]}, "allows 1 value"),
        ({"const": "only"}, "single value"),
        ({"type": "string", "enum": ["a", "a"]}, "repeat"),
        ({"enum": [1.5, 2.5]}, "strings or integers"),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "one const value"),
        ({"type": "null"}, "always null"),
        ({}, "no decidable type"),
        ({"$ref": "#/$defs/Missing"}, "does not resolve"),
        ({"$ref": "https://example.com/s.json"}, "only local $ref"),
        ({"$ref": "#/$defs/Loop"}, "too deep or cyclic"),
        ("not a schema", "must be an object"),
    ],
)
def test_every_undecidable_property_is_refused_naming_it(prop: Any, words: str) -> None:
    schema = {
        "type": "object",
        "$defs": {"Loop": {"$ref": "#/$defs/Loop"}},
        "properties": {"fine": {"type": "boolean"}, "bad_field": prop},
    }
    error = _refused(schema)
    assert error["loc"] == (*SCHEMA_LOC, "properties", "bad_field")
    assert words in error["msg"]
    if isinstance(prop, dict) and "$ref" not in prop:
        assert "'bad_field'" in error["msg"]


def test_every_bad_property_is_listed() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "boolean"}, "c": {"type": "number"}},
    }
    with pytest.raises(RequestValidationError) as info:
        schema_questions(schema)
    assert [e["loc"][-1] for e in info.value.errors] == ["a", "c"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {}},
        {"type": "object"},
        {"type": "array", "items": {"type": "boolean"}},
        {"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(65)}},
        [1, 2],
    ],
)
def test_a_root_without_decidable_properties_is_refused(schema: Any) -> None:
    assert _refused(schema)["loc"][:3] == SCHEMA_LOC


# --------------------------------------------------------------------------------------------- requests

SCHEMA = {"type": "object", "properties": {"urgent": {"type": "boolean"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}


def _request(**overrides: Any) -> dict[str, Any]:
    return {
        "model": "gpt-x",
        "messages": [{"role": "user", "content": "Help now!"}],
        "response_format": FORMAT,
        **overrides,
    }


def _mapped(**overrides: Any) -> tuple[dict[str, Any], ChatPlan]:
    return to_systemone(parse_chat_request(_request(**overrides)))


def test_messages_become_a_message_array_state_with_system_messages() -> None:
    body, plan = _mapped(
        messages=[
            {"role": "system", "content": "You triage tickets."},
            {"role": "developer", "content": [{"type": "text", "text": "Be strict."}]},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "refusal": None},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        ],
        temperature=0.2,
        top_p=0.5,
        seed=7,
        max_tokens=10,
        max_completion_tokens=5,
        presence_penalty=1,
        user="u",
    )
    assert body["state"] == [
        {"role": "system", "content": "You triage tickets."},
        {"role": "developer", "content": "Be strict."},
        {"role": "user", "content": ["a", "b"]},
        {"role": "assistant", "content": "no"},
    ]
    assert body["questions"] == {"urgent": {"type": "noul"}}
    assert body["model"] == "gpt-x"
    assert not plan.stream and not plan.logprobs and "images" not in body


def test_image_parts_go_to_images_and_their_errors_point_back_at_the_part() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}
    body, plan = _mapped(
        messages=[
            {"role": "user", "content": [image]},
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]},
        ]
    )
    assert body["images"] == [image, image]
    assert body["state"] == [{"role": "user", "content": "what is it?"}]  # the image-only message is left out
    assert plan.image_locs == (("messages", 0, "content", 0), ("messages", 1, "content", 1))
    assert translate_error_loc(("images", 1), plan) == ("messages", 1, "content", 1)
    assert translate_error_loc(("questions", "urgent", "instructions"), plan) == (
        *SCHEMA_LOC,
        "properties",
        "urgent",
    )
    assert translate_error_loc(("state",), plan) == ("messages",)


@pytest.mark.parametrize(
    ("overrides", "loc", "words"),
    [
        ({"n": 2}, ("n",), "n must be 1"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            ("tools", 0, "function", "parameters"),
            "parameters schema",
        ),
        ({"functions": [{"name": "f", "parameters": {}}]}, ("functions",), "send the function as tools"),
        ({"functions": [{"name": "f"}]}, ("functions",), "not supported"),
        ({"response_format": None}, ("response_format",), "needs response_format"),
        ({"response_format": {"type": "text"}}, ("response_format",), "'text'"),
        ({"response_format": {"type": "json_object"}}, ("response_format",), "'json_object'"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}},
            ("response_format",),
            "needs",
        ),
        ({"messages": []}, ("messages",), "at least 1"),
        ({"messages": "hi"}, ("messages",), "messages must be an array, got a string"),
        ({"messages": ["hi"]}, ("messages", 0), "object"),
        ({"messages": [{"content": "hi"}]}, ("messages", 0, "role"), "role"),
        ({"messages": [{"role": "user", "content": 5}]}, ("messages", 0, "content"), "string or an array"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            ("messages", 0, "content", 0),
            "input_audio",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            ("messages", 0, "content", 0),
            "part",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]},
            ("messages", 0, "tool_calls", 0),
            "a tool call must be",
        ),
        ({"stream": "yes"}, ("stream",), "stream must be true or false, got a string"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            ("messages", 0, "role"),
            "role must be one of 'system', 'developer', 'user', 'assistant', 'tool', 'function' "
            "(got 'robot')",
        ),
        (
            {
                "response_format": None,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "tool_choice": "none",
            },
            ("tool_choice",),
            "tool_choice is 'none', so the tools cannot be called",
        ),
    ],
)
def test_requests_that_cannot_be_decided_are_refused_naming_the_field(
    overrides: dict[str, Any], loc: tuple[Any, ...], words: str
) -> None:
    assert_refused(lambda: _mapped(**overrides), loc, words)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(RequestValidationError):
        parse_chat_request([1])


# -------------------------------------------------------------------------------------------- responses

SYSTEMONE = {
    **ENGINE_REPLY,
    "answers": {
        **ENGINE_REPLY["answers"],
        "code": {
            "type": "choice",
            "choice": "404",
            "confidence": 1.0,
            "probabilities": {"200": 0.0, "404": 1.0},
        },
    },
}
COMPLETION_SCHEMA = {
    "type": "object",
    "properties": {
        "team": {"enum": ["billing", "tech", "sales"]},
        "urgent": {"type": "boolean"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 3},
        "code": {"type": "integer", "enum": [200, 404]},
    },
}


def _plan(**overrides: Any) -> ChatPlan:
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": COMPLETION_SCHEMA}}
    return _mapped(response_format=fmt, **overrides)[1]


def test_the_completion_carries_typed_answers_usage_and_the_systemone_answers() -> None:
    out = to_chat_completion(SYSTEMONE, _plan(), completion_id="chatcmpl-1", created=5)
    choice = out["choices"][0]
    assert json.loads(choice["message"]["content"]) == {
        "team": "tech",
        "urgent": False,
        "priority": 2,
        "code": 404,
    }
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert choice["logprobs"] is None
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-1" and out["created"] == 5
    assert out["usage"]["prompt_tokens"] == 42 and out["usage"]["completion_tokens"] == 0
    assert out["usage"]["total_tokens"] == 42
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
    assert out["x_decisions"] == SYSTEMONE["answers"]
    assert out["x_state_cache"] == "partial"
    assert out["model"] == "gpt-x"


def test_a_tie_takes_the_first_level_and_noul_one_half_is_true() -> None:
    answers = json.loads(json.dumps(SYSTEMONE))
    answers["answers"]["priority"]["probabilities"] = {"0": 0.4, "1": 0.4, "2": 0.2}
    answers["answers"]["urgent"]["noul"] = 0.5
    content = json.loads(
        to_chat_completion(answers, _plan(), completion_id="c", created=0)["choices"][0]["message"]["content"]
    )
    assert content["priority"] == 1 and content["urgent"] is True


def test_logprobs_hold_one_entry_per_field_with_every_option() -> None:
    out = to_chat_completion(SYSTEMONE, _plan(logprobs=True, top_logprobs=2), completion_id="c", created=0)
    content = out["choices"][0]["logprobs"]["content"]
    assert [entry["x_field"] for entry in content] == ["team", "urgent", "priority", "code"]
    team, urgent, priority, code = content
    assert team["token"] == '"tech"' and team["logprob"] == pytest.approx(math.log(0.6))
    assert [t["token"] for t in team["top_logprobs"]] == ['"billing"', '"tech"', '"sales"']
    assert team["bytes"] == list(b'"tech"')
    assert urgent["token"] == "false" and urgent["logprob"] == pytest.approx(math.log(0.75))
    assert [(t["token"], round(math.exp(t["logprob"]), 4)) for t in urgent["top_logprobs"]] == [
        ("true", 0.25),
        ("false", 0.75),
    ]
    assert priority["token"] == "2" and [t["token"] for t in priority["top_logprobs"]] == ["1", "2", "3"]
    assert code["token"] == "404" and code["top_logprobs"][0]["logprob"] == -9999.0  # p rounds to 0


def test_the_stream_is_one_content_chunk_then_usage_when_asked() -> None:
    plan = _plan(stream=True, stream_options={"include_usage": True})
    completion = to_chat_completion(SYSTEMONE, plan, completion_id="c", created=1)
    chunks = to_chat_chunks(completion, plan)
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 2
    assert chunks[0]["choices"][0]["delta"] == {
        "role": "assistant",
        "content": completion["choices"][0]["message"]["content"],
    }
    assert chunks[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[0]["x_decisions"] == SYSTEMONE["answers"]
    assert chunks[1]["choices"] == [] and chunks[1]["usage"]["prompt_tokens"] == 42
    assert len(to_chat_chunks(completion, _plan(stream=True))) == 1


# ----------------------------------------------------------------------------------------- function tools

TICKET_TOOL = {
    "type": "function",
    "function": {
        "name": "Ticket",
        "description": "Correctly extracted `Ticket`",
        "parameters": COMPLETION_SCHEMA,
    },
}


def test_a_function_tool_is_decided_like_a_response_format_and_wins_over_one() -> None:
    by_format, format_plan = _mapped(
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": COMPLETION_SCHEMA}}
    )
    by_tool, tool_plan = _mapped(
        tools=[TICKET_TOOL],
        tool_choice={"type": "function", "function": {"name": "Ticket"}},
        parallel_tool_calls=False,
    )  # the request's own response_format (FORMAT, one boolean) is not what is decided
    assert by_tool == by_format and tool_plan.fields == format_plan.fields
    assert tool_plan.tool_name == "Ticket" and format_plan.tool_name is None
    # A property the engine refuses is located in the tool's parameters.
    assert translate_error_loc(("questions", "team", "criteria"), tool_plan) == (
        "tools",
        0,
        "function",
        "parameters",
        "properties",
        "team",
    )
    # No call with "none", nor with "auto" (or no choice) next to a response_format: the format is decided.
    for choice in ("none", "auto", None):
        _, plan = _mapped(tools=[TICKET_TOOL], tool_choice=choice)
        assert plan.tool_name is None and [f.name for f in plan.fields] == ["urgent"]
    _, plan = _mapped(tools=[TICKET_TOOL], response_format=None, tool_choice="auto")
    assert plan.tool_name == "Ticket"  # without a format, "auto" calls the only tool


def test_an_undecidable_tool_property_is_refused_at_the_tool() -> None:
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"properties": {"why": {"type": "string"}}}},
    }
    with pytest.raises(RequestValidationError) as info:
        _mapped(tools=[tool], tool_choice="required")
    assert info.value.errors[0]["loc"] == ("tools", 0, "function", "parameters", "properties", "why")


def test_the_reply_is_one_call_of_the_requested_tool() -> None:
    plan = _mapped(tools=[TICKET_TOOL], tool_choice="required", logprobs=True)[1]
    out = to_chat_completion(SYSTEMONE, plan, completion_id="chatcmpl-abc", created=5)
    choice = out["choices"][0]
    message = choice["message"]
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["id"] == "call_abc" and call["type"] == "function" and call["function"]["name"] == "Ticket"
    assert json.loads(call["function"]["arguments"]) == {
        "team": "tech",
        "urgent": False,
        "priority": 2,
        "code": 404,
    }
    assert [entry["x_field"] for entry in choice["logprobs"]["content"]] == [
        "team",
        "urgent",
        "priority",
        "code",
    ]
    assert out["x_decisions"] == SYSTEMONE["answers"]


def test_a_streamed_call_comes_whole_then_its_finish_reason_then_usage() -> None:
    plan = _mapped(
        tools=[TICKET_TOOL], tool_choice="required", stream=True, stream_options={"include_usage": True}
    )[1]
    completion = to_chat_completion(SYSTEMONE, plan, completion_id="chatcmpl-s", created=1)
    first, finish, usage = to_chat_chunks(completion, plan)
    delta = first["choices"][0]["delta"]
    assert delta["role"] == "assistant" and delta["content"] is None
    assert delta["tool_calls"] == [{"index": 0, **completion["choices"][0]["message"]["tool_calls"][0]}]
    assert first["choices"][0]["finish_reason"] is None
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 42


def test_a_retry_history_with_tool_calls_and_tool_messages_becomes_part_of_the_state() -> None:
    arguments = '{"team": "sales", "urgent": true}'
    body, _ = _mapped(
        tools=[TICKET_TOOL],
        messages=[
            {"role": "user", "content": "Help now!"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "Ticket", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Validation error: team must be billing"},
            {"role": "assistant", "function_call": {"name": "Ticket", "arguments": "not json"}},
            {"role": "function", "name": "Ticket", "content": "still wrong"},
        ],
    )
    assert body["state"] == [
        {"role": "user", "content": "Help now!"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "Ticket", "arguments": json.loads(arguments)}],
        },
        {"role": "tool", "content": "Validation error: team must be billing"},
        {"role": "assistant", "tool_calls": [{"name": "Ticket", "arguments": "not json"}]},
        {"role": "function", "name": "Ticket", "content": "still wrong"},
    ]
    parse_request(body)  # a valid System One request
