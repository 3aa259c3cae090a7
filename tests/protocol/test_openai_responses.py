"""The Responses API mapping: instructions and input items -> state, text.format or a function tool ->
questions, answers -> a Response object, and everything that cannot be honoured refused naming its field."""

from __future__ import annotations

import json
import math
from typing import Any, Literal, get_args

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib._parsing._responses import type_to_text_format_param
from openai.lib._tools import pydantic_responses_function_tool
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, Field

from clef_runtime.protocol import openai_chat
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.openai_responses import (
    TEXT_SCHEMA_LOC,
    ResponsesPlan,
    parse_responses_request,
    to_response,
    to_response_events,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.protocol.systemone import parse_request
from tests.protocol.openai_common import ENGINE_REPLY as SYSTEMONE
from tests.protocol.openai_common import assert_refused

SCHEMA = {"type": "object", "properties": {"urgent": {"type": "boolean"}}}
FORMAT = {"type": "json_schema", "name": "t", "schema": SCHEMA, "strict": True}
TOOL_SCHEMA = {"type": "object", "properties": {"team": {"type": "string", "enum": ["billing", "tech"]}}}
TOOL = {"type": "function", "name": "route", "parameters": TOOL_SCHEMA, "strict": True}
PNG = "data:image/png;base64,iVBORw0KGgo="


def _request(**overrides: Any) -> dict[str, Any]:
    return {"model": "gpt-x", "input": "Help now!", "text": {"format": FORMAT}, **overrides}


def _mapped(**overrides: Any) -> tuple[dict[str, Any], ResponsesPlan]:
    return to_systemone(parse_responses_request(_request(**overrides)))


def _chat_state(messages: list[dict[str, Any]]) -> Any:
    """The state /v1/chat/completions makes of ``messages``."""
    chat = {"messages": messages, "response_format": {"type": "json_schema", "json_schema": FORMAT}}
    return openai_chat.to_systemone(openai_chat.parse_chat_request(chat))[0]["state"]


class Ticket(BaseModel):
    team: Literal["billing", "tech", "sales"] = Field(description="Which team should handle it?")
    urgent: bool
    priority: int = Field(ge=1, le=3, description="How urgent, 1 to 3")


TICKET_QUESTIONS = {
    "team": {
        "type": "choice",
        "instructions": "Which team should handle it?",
        "criteria": {"billing": None, "tech": None, "sales": None},
    },
    "urgent": {"type": "noul", "instructions": "Urgent"},
    "priority": {"type": "score", "instructions": "How urgent, 1 to 3", "criteria": ["1", "2", "3"]},
}


# ---------------------------------------------------------------------------------------------- input


def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    body, plan = _mapped(
        instructions="You triage tickets.",
        temperature=0.2,
        top_p=0.5,
        max_output_tokens=16,
        store=True,
        parallel_tool_calls=False,
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "low"},
        truncation="auto",
        metadata={"k": "v"},
        user="u",
        service_tier="auto",
        prompt_cache_key="p",
    )
    assert body == {
        "state": [
            {"role": "system", "content": "You triage tickets."},
            {"role": "user", "content": "Help now!"},
        ],
        "questions": {"urgent": {"type": "noul"}},
        "model": "gpt-x",
    }
    parse_request(body)  # a valid System One request
    chat = [{"role": "system", "content": "You triage tickets."}, {"role": "user", "content": "Help now!"}]
    assert _chat_state(chat) == body["state"]  # the same decision as the same chat conversation
    assert plan.tool_name is None and plan.schema_loc == TEXT_SCHEMA_LOC and not plan.logprobs
    assert plan.echo["instructions"] == "You triage tickets." and plan.echo["parallel_tool_calls"] is False
    assert plan.echo["metadata"] == {"k": "v"} and plan.echo["temperature"] == 0.2
    assert plan.echo["text"] == {"format": FORMAT}


def test_the_sdks_text_format_of_a_pydantic_model_is_decided_field_by_field() -> None:
    body, plan = _mapped(text={"format": type_to_text_format_param(Ticket)})
    assert body["questions"] == TICKET_QUESTIONS
    assert list(body["questions"]) == ["team", "urgent", "priority"]  # schema order
    assert [f.kind for f in plan.fields] == ["choice", "boolean", "integer"]


def test_message_items_keep_their_texts_in_order() -> None:
    body, _ = _mapped(
        input=[
            {"role": "developer", "content": "Be strict."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "b"}, {"type": "input_text", "text": "c"}],
            },
            {  # an assistant message replayed from an earlier Response's output
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}],
            },
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "..."},
        ]
    )
    assert body["state"] == [
        {"role": "developer", "content": "Be strict."},
        {"role": "user", "content": "a"},
        {"role": "user", "content": ["b", "c"]},
        {"role": "assistant", "content": "ok"},
        {"role": "assistant", "content": "no"},
    ]


def test_function_calls_and_outputs_become_chats_tool_calls_and_tool_messages() -> None:
    body, _ = _mapped(
        input=[
            {"role": "user", "content": "Route it."},
            {"role": "assistant", "content": "Looking it up."},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"order": 7}'},
            {"type": "function_call", "call_id": "c2", "name": "ping", "arguments": "not json"},
            {"type": "function_call_output", "call_id": "c1", "output": "charged twice"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "up"}],
            },
            {"type": "function_call", "id": "fc_9", "call_id": "c3", "name": "route", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c3", "output": ""},
        ]
    )
    assert body["state"] == [
        {"role": "user", "content": "Route it."},
        {
            "role": "assistant",
            "content": "Looking it up.",
            "tool_calls": [
                {"name": "lookup", "arguments": {"order": 7}},
                {"name": "ping", "arguments": "not json"},
            ],
        },
        {"role": "tool", "content": "charged twice"},
        {"role": "tool", "content": "up"},
        {"role": "assistant", "tool_calls": [{"name": "route", "arguments": {}}]},
        {"role": "tool", "content": ""},
    ]
    # The same conversation sent to /v1/chat/completions is the same state, byte for byte (key order too).
    chat = [
        {"role": "user", "content": "Route it."},
        {
            "role": "assistant",
            "content": "Looking it up.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"order": 7}'}},
                {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "charged twice"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "up"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "route", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": ""},
    ]
    assert json.dumps(_chat_state(chat)) == json.dumps(body["state"])


def test_image_parts_go_to_images_and_their_errors_point_back_at_the_part() -> None:
    image = {"type": "input_image", "image_url": PNG, "detail": "low"}
    body, plan = _mapped(
        input=[
            {"role": "user", "content": [image]},
            {"role": "user", "content": [{"type": "input_text", "text": "what is it?"}, image]},
            {"type": "function_call_output", "call_id": "c", "output": [image]},
        ]
    )
    assert body["images"] == [image, image, image]
    # the image-only message is left out; an image-only tool output stays, empty
    assert body["state"] == [{"role": "user", "content": "what is it?"}, {"role": "tool", "content": ""}]
    assert plan.image_locs == (
        ("input", 0, "content", 0),
        ("input", 1, "content", 1),
        ("input", 2, "output", 0),
    )
    assert translate_error_loc(("images", 1), plan) == ("input", 1, "content", 1)
    assert translate_error_loc(("images", 2), plan) == ("input", 2, "output", 0)
    assert translate_error_loc(("images",), plan) == ("input",)
    assert translate_error_loc(("state",), plan) == ("input",)
    assert translate_error_loc(("questions", "urgent", "instructions"), plan) == (
        *TEXT_SCHEMA_LOC,
        "properties",
        "urgent",
    )
    assert translate_error_loc(("model",), plan) == ("model",)


def test_images_alone_give_an_empty_state() -> None:
    body, _ = _mapped(input=[{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}])
    assert body["state"] == "" and len(body["images"]) == 1


# ---------------------------------------------------------------------------------------------- tools


def test_a_function_tool_wins_over_the_text_format_and_locates_its_errors() -> None:
    body, plan = _mapped(tools=[TOOL], tool_choice="required")
    assert body["questions"] == {"team": {"type": "choice", "criteria": {"billing": None, "tech": None}}}
    assert plan.tool_name == "route" and plan.schema_loc == ("tools", 0, "parameters")
    assert translate_error_loc(("questions", "team"), plan) == (
        "tools",
        0,
        "parameters",
        "properties",
        "team",
    )
    assert plan.echo["tools"] == [TOOL] and plan.echo["tool_choice"] == "required"


@pytest.mark.parametrize(
    "tool_choice",
    [
        None,
        "auto",
        "required",
        {"type": "function", "name": "route"},
        {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "route"}]},
    ],
)
def test_the_only_tool_or_the_named_one_is_called(tool_choice: Any) -> None:
    other = {"type": "function", "name": "other", "parameters": SCHEMA}
    tools = [TOOL] if tool_choice in (None, "auto", "required") else [other, TOOL]
    choice = {} if tool_choice is None else {"tool_choice": tool_choice}
    _, plan = _mapped(tools=tools, text=None, **choice)
    assert plan.tool_name == "route"
    if tool_choice not in (None, "auto"):  # a forced or required call wins over a text format
        assert _mapped(tools=tools, **choice)[1].tool_name == "route"


@pytest.mark.parametrize("tool_choice", ["none", "auto", None])
def test_a_text_format_is_decided_unless_a_call_is_forced_or_required(tool_choice: Any) -> None:
    _, plan = _mapped(tools=[TOOL], **({} if tool_choice is None else {"tool_choice": tool_choice}))
    assert plan.tool_name is None and plan.schema_loc == TEXT_SCHEMA_LOC


def test_the_sdks_pydantic_function_tool_is_decided() -> None:
    tool = pydantic_responses_function_tool(Ticket)
    body, plan = _mapped(tools=[dict(tool)], text=None)
    assert body["questions"] == TICKET_QUESTIONS and plan.tool_name == "Ticket"


# -------------------------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("overrides", "loc", "words"),
    [
        ({"n": 2}, ("n",), "n must be 1"),
        ({"stream": "yes"}, ("stream",), "stream must be true or false, got a string"),
        ({"previous_response_id": "resp_1"}, ("previous_response_id",), "stores no responses"),
        ({"conversation": "conv_1"}, ("conversation",), "send the whole conversation"),
        ({"prompt": {"id": "pmpt_1"}}, ("prompt",), "stored by OpenAI"),
        ({"background": True}, ("background",), "nothing to poll"),
        ({"text": None}, ("text", "format"), "got text.format none"),
        ({"text": {"format": {"type": "text"}}}, ("text", "format"), "got text.format 'text'"),
        ({"text": {"format": {"type": "json_object"}}}, ("text", "format"), "'json_object'"),
        ({"text": {"format": {"type": "json_schema", "name": "t"}}}, TEXT_SCHEMA_LOC, "needs its schema"),
        ({"text": {"format": "json"}}, ("text", "format"), "object"),
        ({"instructions": 5}, ("instructions",), "instructions"),
        ({"include": "all"}, ("include",), "include"),
        ({"input": None}, ("input",), "input must be a string or a non-empty array"),
        ({"input": []}, ("input",), "non-empty array"),
        ({"input": 5}, ("input",), "non-empty array"),
        ({"input": ["hi"]}, ("input", 0), "must be an object"),
        ({"input": [{"content": "hi"}]}, ("input", 0, "role"), "needs a role"),
        ({"input": [{"role": "user", "content": 5}]}, ("input", 0, "content"), "string or an array"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            ("input", 0, "content", 0),
            "input_file parts are not supported",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            ("input", 0, "content", 0),
            "input_audio",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "text", "text": "chat's part"}]}]},
            ("input", 0, "content", 0),
            "input_text",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            ("input", 0, "name"),
            "needs a name",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c"}]},
            ("input", 0, "output"),
            "needs its output",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
            ("input", 0, "output"),
            "string or an array",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, ("input", 0, "type"), "nothing is stored"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, ("input", 0, "type"), "'web_search_call'"),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": "required"},
            ("tools", 0, "type"),
            "only function tools",
        ),
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"},
            ("tools", 0, "parameters"),
            "parameters schema",
        ),
        ({"tools": [TOOL, {**TOOL, "name": "b"}], "text": None}, ("tool_choice",), "2 tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "x"}}, ("tool_choice", "name"), "'x'"),
        ({"tool_choice": "required"}, ("tool_choice",), "no tools"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            ("tool_choice", "tools"),
            "exactly one function",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "tools": [{"type": "mcp"}]}},
            ("tool_choice", "tools", 0),
            "{type: 'function', name}",
        ),
        ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, ("tool_choice", "type"), "file_search"),
        (
            {"input": [{"role": "robot", "content": "hi"}]},
            ("input", 0, "role"),
            "role must be one of 'system', 'developer', 'user', 'assistant' (got 'robot')",
        ),
        (
            {"input": [{"type": "message", "role": "tool", "content": "hi"}]},
            ("input", 0, "role"),
            "(got 'tool')",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "route", "parameters": TOOL_SCHEMA}}],
                "tool_choice": "required",
            },
            ("tools", 0),
            "Responses API function tools are flat: {type: 'function', name, parameters}",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "route"}}},
            ("tool_choice",),
            "tool_choice {type: 'function', name}",
        ),
        (
            {"tools": [TOOL], "tool_choice": "none", "text": None},
            ("tool_choice",),
            "a decision is answered through one function tool or a json_schema text.format",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(
    overrides: dict[str, Any], loc: tuple[Any, ...], words: str
) -> None:
    assert_refused(lambda: _mapped(**overrides), loc, words)


def test_undecidable_properties_are_named_under_the_text_format_or_the_tool() -> None:
    bad = {"type": "object", "properties": {"ok": {"type": "boolean"}, "summary": {"type": "string"}}}
    with pytest.raises(RequestValidationError) as info:
        _mapped(text={"format": {**FORMAT, "schema": bad}})
    assert info.value.errors[0]["loc"] == (*TEXT_SCHEMA_LOC, "properties", "summary")
    assert "a free string" in info.value.errors[0]["msg"]
    with pytest.raises(RequestValidationError) as info:
        _mapped(tools=[{**TOOL, "parameters": bad}], tool_choice="required")
    assert info.value.errors[0]["loc"] == ("tools", 0, "parameters", "properties", "summary")


def test_with_tool_choice_none_the_tools_are_not_looked_at() -> None:
    body, plan = _mapped(tools=[{"type": "web_search"}], tool_choice="none")
    assert body["questions"] == {"urgent": {"type": "noul"}} and plan.tool_name is None


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(RequestValidationError) as info:
        parse_responses_request([1])
    assert info.value.errors[0]["loc"] == ()


def test_input_is_required() -> None:
    with pytest.raises(RequestValidationError) as info:
        parse_responses_request({"model": "m", "text": {"format": FORMAT}})
    assert info.value.errors[0]["loc"] == ("input",) and info.value.errors[0]["type"] == "missing"


# ------------------------------------------------------------------------------------------- response

TICKET_FORMAT = {"format": {"type": "json_schema", "name": "ticket", "schema": Ticket.model_json_schema()}}


def test_the_response_is_one_message_with_the_json_of_the_answers() -> None:
    _, plan = _mapped(text=TICKET_FORMAT, instructions="Triage.", metadata={"k": "v"})
    out = to_response(SYSTEMONE, plan, request_id="abc", created=7)
    (message,) = out["output"]
    assert message == {
        "type": "message",
        "id": "msg_abc",
        "role": "assistant",
        "status": "completed",
        "content": [
            {
                "type": "output_text",
                "text": json.dumps({"team": "tech", "urgent": False, "priority": 2}),
                "annotations": [],
                "logprobs": [],
            }
        ],
    }
    assert out["id"] == "resp_abc" and out["object"] == "response" and out["status"] == "completed"
    assert out["created_at"] == 7 and out["model"] == "gpt-x"
    assert out["error"] is None and out["incomplete_details"] is None and out["previous_response_id"] is None
    assert out["usage"] == {
        "input_tokens": 42,
        "input_tokens_details": {"cached_tokens": 36},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 42,
    }
    assert out["instructions"] == "Triage." and out["metadata"] == {"k": "v"}
    assert out["text"] == TICKET_FORMAT and out["tools"] == [] and out["tool_choice"] == "auto"
    assert out["parallel_tool_calls"] is True and out["store"] is False
    assert out["x_decisions"] == SYSTEMONE["answers"] and out["x_state_cache"] == "partial"
    assert "output_text" not in out  # an SDK convenience, computed from output


def test_logprobs_come_when_included_one_entry_per_field() -> None:
    _, plan = _mapped(text=TICKET_FORMAT, include=["message.output_text.logprobs"], top_logprobs=3)
    logprobs = to_response(SYSTEMONE, plan, request_id="a", created=0)["output"][0]["content"][0]["logprobs"]
    assert [entry["x_field"] for entry in logprobs] == ["team", "urgent", "priority"]
    team, urgent, priority = logprobs
    assert team["token"] == '"tech"' and team["logprob"] == pytest.approx(math.log(0.6))
    assert [t["token"] for t in team["top_logprobs"]] == ['"billing"', '"tech"', '"sales"']
    assert urgent["token"] == "false" and urgent["logprob"] == pytest.approx(math.log(0.75))
    assert priority["token"] == "2" and [t["token"] for t in priority["top_logprobs"]] == ["1", "2", "3"]


def test_a_tool_is_answered_by_one_function_call() -> None:
    tool = {"type": "function", "name": "ticket", "parameters": Ticket.model_json_schema()}
    _, plan = _mapped(
        tools=[tool], tool_choice={"type": "function", "name": "ticket"}, parallel_tool_calls=True
    )
    out = to_response({**SYSTEMONE, "model": "tiny"}, plan, request_id="abc", created=0)
    assert out["output"] == [
        {
            "type": "function_call",
            "id": "fc_abc",
            "call_id": "call_abc",
            "name": "ticket",
            "arguments": json.dumps({"team": "tech", "urgent": False, "priority": 2}),
            "status": "completed",
        }
    ]
    assert out["tools"] == [tool] and out["tool_choice"] == {"type": "function", "name": "ticket"}
    assert out["model"] == "tiny"


def test_the_model_falls_back_to_the_requested_one() -> None:
    _, plan = _mapped(text=TICKET_FORMAT)
    answer = {k: v for k, v in SYSTEMONE.items() if k not in ("model", "x_state_cache")}
    out = to_response(answer, plan, request_id="r", created=0)
    assert out["model"] == "gpt-x" and "x_state_cache" not in out


# --------------------------------------------------------------------------------------------- stream

MESSAGE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
CALL_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


EVENT_CLASSES: dict[str, type[BaseModel]] = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])
}
"""The ``openai`` package's typed stream event class of each event type."""


def _check_typed(events: list[dict[str, Any]]) -> None:
    """Each event validates strictly as the ``openai`` package's typed event of its type (every required
    field present and typed). The completed Response's ``usage`` is left out: it is the unstreamed
    Response's usage, which the SDK reads laxly (it has no ``cache_write_tokens``)."""
    for event in events:
        if event["type"] == "response.completed":
            event = {**event, "response": {**event["response"], "usage": None}}
        EVENT_CLASSES[event["type"]].model_validate(event)


def _accumulated(events: list[dict[str, Any]], **state: Any) -> Any:
    """The final response the SDK's ``responses.stream`` builds from ``events``, each read as the SDK's
    stream reads it."""
    _check_typed(events)
    accumulator = ResponseStreamState(**{"input_tools": omit, "text_format": omit, **state})
    for event in events:
        accumulator.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    return accumulator._completed_response


def test_the_stream_is_the_message_whole_in_one_delta_numbered_from_zero() -> None:
    _, plan = _mapped(text=TICKET_FORMAT, include=["message.output_text.logprobs"], stream=True)
    assert plan.stream
    response = {**to_response(SYSTEMONE, plan, request_id="abc", created=7), "x_latency_ms": 3.5}
    events = to_response_events(response)
    assert [event["type"] for event in events] == MESSAGE_EVENTS
    assert [event["sequence_number"] for event in events] == list(range(len(MESSAGE_EVENTS)))
    created, in_progress, added, part_added, delta, text_done, part_done, item_done, completed = events
    assert created["response"] == in_progress["response"]
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []
    assert created["response"]["usage"] is None and created["response"]["id"] == "resp_abc"
    assert not [key for key in created["response"] if key.startswith("x_")]
    (part,) = response["output"][0]["content"]
    assert added["item"] == {**response["output"][0], "status": "in_progress", "content": []}
    assert part_added["part"] == {**part, "text": "", "logprobs": []}
    assert delta["delta"] == text_done["text"] == part["text"] and delta["logprobs"] == part["logprobs"]
    for event in (part_added, delta, text_done, part_done):
        assert (event["item_id"], event["output_index"], event["content_index"]) == ("msg_abc", 0, 0)
    assert part_done["part"] == part and item_done["item"] == response["output"][0]
    assert completed["response"] == response  # usage and the x_ extras as unstreamed
    final = _accumulated(events, text_format=Ticket)
    assert final.output_text == part["text"] and final.usage.input_tokens == 42
    assert final.output_parsed == Ticket(team="tech", urgent=False, priority=2)


def test_a_streamed_function_call_is_its_arguments_in_one_delta() -> None:
    tool = {"type": "function", "name": "ticket", "parameters": Ticket.model_json_schema()}
    _, plan = _mapped(tools=[tool], tool_choice={"type": "function", "name": "ticket"}, stream=True)
    response = to_response(SYSTEMONE, plan, request_id="abc", created=0)
    events = to_response_events(response)
    assert [event["type"] for event in events] == CALL_EVENTS
    assert [event["sequence_number"] for event in events] == list(range(len(CALL_EVENTS)))
    (call,) = response["output"]
    added, delta, done = events[2:5]
    assert added["item"] == {**call, "status": "in_progress", "arguments": ""}
    assert delta["delta"] == done["arguments"] == call["arguments"]
    assert (
        (delta["item_id"], delta["output_index"]) == (done["item_id"], done["output_index"]) == ("fc_abc", 0)
    )
    final = _accumulated(events)
    assert [item.arguments for item in final.output] == [call["arguments"]]
