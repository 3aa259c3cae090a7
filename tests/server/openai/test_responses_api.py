"""``POST /v1/responses``: the official ``openai`` client, unchanged, against a live loopback server running
the tiny model (``responses.parse`` with a Pydantic model, ``responses.create`` with a raw schema, function
tools, a history of calls, errors, auth), each answer checked against the argmax of an equivalent
hand-written /v1/systemone request; and, against the fake engine, the published docs and the README's
snippet.
"""

from __future__ import annotations

import ast
import copy
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from devtools.fake_engine import FakeClef
from fastapi.testclient import TestClient

from clef_runtime.engine.clef import Clef
from clef_runtime.server.openai.docs import RESPONSES_EXAMPLES
from tests.clients.common import SYSTEM, USER, Mood, Ticket
from tests.live_server import Live, first_max, systemone
from tests.protocol.test_openai_responses import CALL_EVENTS, MESSAGE_EVENTS
from tests.readme_snippets import python_snippets, run_snippet
from tests.server.conftest import LiveServer
from tests.server.openai.test_openai_client import EQUIVALENT, SCHEMA

TEXT_FORMAT = {"format": {"type": "json_schema", "name": "ticket", "schema": SCHEMA, "strict": True}}
TOOL = {"type": "function", "name": "ticket", "parameters": SCHEMA, "strict": True}
LOOKUP_ARGUMENTS = {"order": 1042}
LOOKUP_OUTPUT = "order 1042: charged twice on 2024-05-01"


# ------------------------------------------------------------------------------------- fake engine


def test_the_operation_is_documented_with_examples_that_are_accepted(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    op = schema["paths"]["/v1/responses"]["post"]
    assert op["summary"] and "previous_response_id" in op["description"] and "stream" in op["description"]
    assert set(op["responses"]) >= {"200", "400", "401", "429", "503"}
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"
    }
    assert "input" in schema["components"]["schemas"]["ResponsesRequest"]["properties"]
    for name, example in RESPONSES_EXAMPLES.items():
        response = client.post("/v1/responses", json=example["value"])
        assert response.status_code == 200, (name, response.text)
        body = response.json()
        assert body["object"] == "response" and body["status"] == "completed"
        kind = "function_call" if "tools" in example["value"] else "message"
        assert [item["type"] for item in body["output"]] == [kind]
        assert body["x_truncated_state_tokens"] == 0


def _sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """The ``(event name, data)`` of each server-sent event of ``response``."""
    events = []
    for block in response.text.split("\n\n"):
        if block:
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            events.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return events


def test_stream_true_is_the_event_stream_of_the_same_response(client: TestClient) -> None:
    body = {**RESPONSES_EXAMPLES["json_schema"]["value"], "stream": True}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] and response.headers["X-Clef-State-Cache"]
    events = _sse(response)
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    plain = client.post("/v1/responses", json={**body, "stream": False}).json()
    completed = events[-1][1]["response"]
    assert completed["output"][0]["content"] == plain["output"][0]["content"]
    assert completed["usage"] == plain["usage"] and completed["x_decisions"] == plain["x_decisions"]
    (delta,) = [data for name, data in events if name == "response.output_text.delta"]
    assert delta["delta"] == plain["output"][0]["content"][0]["text"]


def test_a_streamed_request_that_fails_is_a_json_error_before_any_event(client: TestClient) -> None:
    body = {
        **RESPONSES_EXAMPLES["json_schema"]["value"],
        "stream": True,
        "text": {"format": {"type": "text"}},
    }
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == "text.format"


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        (
            {
                "tools": [{"type": "function", "function": {"name": "ticket", "parameters": SCHEMA}}],
                "tool_choice": "required",
            },
            "tools[0]",
            "Responses API function tools are flat: {type: 'function', name, parameters}",
        ),
        (
            {"input": [{"role": "robot", "content": USER}]},
            "input[0].role",
            "role must be one of 'system', 'developer', 'user', 'assistant' (got 'robot')",
        ),
        (
            {"tools": [TOOL], "tool_choice": "none", "text": None},
            "tool_choice",
            "a decision is answered through one function tool or a json_schema text.format",
        ),
    ],
)
def test_a_wrong_tool_shape_role_or_tool_choice_is_a_400_naming_the_field(
    client: TestClient, change: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": "clef", "input": USER, "text": TEXT_FORMAT, **change}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"]


def test_the_readme_snippet_runs_as_written(live_fake: Callable[..., LiveServer]) -> None:
    (snippet,) = python_snippets("`POST /v1/responses`: OpenAI's Responses API as one decision")
    served = live_fake(FakeClef())
    parsed, team = run_snippet(snippet, served.url).strip().splitlines()
    assert parsed.startswith("team=") and "refund=" in parsed
    assert ast.literal_eval(team)["type"] == "choice"
    assert len(served.engine.batches) == 1


# ------------------------------------------------------------------------------------ the tiny model


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = Live(Clef.load("tiny", dtype="fp32"), api_keys=("test-key",))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sdk(live: Live) -> openai.OpenAI:
    return openai.OpenAI(api_key="test-key", base_url=live.url + "/v1", max_retries=0, timeout=120)


def argmax_answers(answers: dict[str, Any]) -> dict[str, Any]:
    """The typed answers a client should get: the first most probable option or level, P(true) >= 0.5.
    Score levels are the integers 1, 2, ... of the schemas here."""
    out: dict[str, Any] = {}
    for name, answer in answers.items():
        if answer["type"] == "noul":
            out[name] = answer["noul"] >= 0.5
        else:
            best = first_max(answer["probabilities"])
            out[name] = 1 + int(best) if answer["type"] == "score" else best
    return out


def _ticket_equivalent(state: Any) -> dict[str, Any]:
    """EQUIVALENT with the Ticket model's mood question, on ``state``."""
    equivalent = copy.deepcopy(EQUIVALENT)
    questions = equivalent["questions"]
    mood = {
        "type": "choice",
        "instructions": "How does the customer feel?",
        "criteria": {"calm": None, "annoyed": None, "furious": None},
    }
    equivalent["questions"] = {
        "team": questions["team"],
        "mood": mood,
        "refund": questions["refund"],
        "urgency": questions["urgency"],
    }
    equivalent["state"] = state
    return equivalent


@pytest.mark.slow
def test_parse_with_a_pydantic_model_equals_the_argmax_of_system_one(sdk: openai.OpenAI, live: Live) -> None:
    response = sdk.responses.parse(
        model="tiny", instructions=SYSTEM, input=USER, text_format=Ticket, temperature=0.3, store=True
    )
    ticket = response.output_parsed
    assert isinstance(ticket, Ticket) and isinstance(ticket.mood, Mood)
    direct = systemone(live, _ticket_equivalent(EQUIVALENT["state"]))["answers"]
    assert ticket.model_dump(mode="json") == argmax_answers(direct)
    assert response.status == "completed" and response.object == "response"
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    assert json.loads(response.output_text) == ticket.model_dump(mode="json")


@pytest.mark.slow
def test_create_with_a_raw_schema_logprobs_and_usage(sdk: openai.OpenAI, live: Live) -> None:
    response = sdk.responses.create(
        model="tiny",
        instructions=SYSTEM,
        input=[{"role": "user", "content": [{"type": "input_text", "text": USER}]}],
        text=TEXT_FORMAT,  # type: ignore[arg-type]
        include=["message.output_text.logprobs"],
        max_output_tokens=5,
    )
    direct = systemone(live, EQUIVALENT)
    assert json.loads(response.output_text) == argmax_answers(direct["answers"])
    decisions = response.model_extra["x_decisions"]  # type: ignore[index]
    assert decisions["team"]["probabilities"] == pytest.approx(
        direct["answers"]["team"]["probabilities"], abs=2e-4
    )
    assert response.usage is not None and response.usage.output_tokens == 0
    assert response.usage.input_tokens == direct["usage"]["input_tokens"] == response.usage.total_tokens
    (part,) = response.output[0].content  # type: ignore[union-attr]
    team, refund, urgency = part.logprobs  # type: ignore[union-attr, misc]
    assert [t.token for t in team.top_logprobs] == ['"billing"', '"tech"', '"sales"']
    assert [round(math.exp(t.logprob), 4) for t in team.top_logprobs] == pytest.approx(
        list(decisions["team"]["probabilities"].values()), abs=1e-4
    )
    assert [t.token for t in refund.top_logprobs] == ["true", "false"]
    assert [t.token for t in urgency.top_logprobs] == ["1", "2", "3"]
    assert response.text is not None and response.text.format.type == "json_schema"  # type: ignore[union-attr]

    # The same conversation on /v1/chat/completions is the same decision.
    chat = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        response_format={"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA}},
    )
    assert json.loads(chat.choices[0].message.content or "") == json.loads(response.output_text)


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "Ticket"}, "required", "auto"])
def test_a_pydantic_function_tool_is_answered_by_one_call(
    sdk: openai.OpenAI, live: Live, tool_choice: Any
) -> None:
    response = sdk.responses.parse(
        model="tiny",
        instructions=SYSTEM,
        input=USER,
        tools=[openai.pydantic_function_tool(Ticket)],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "Ticket" and call.call_id.startswith("call_")
    assert isinstance(call.parsed_arguments, Ticket)  # type: ignore[union-attr]
    direct = systemone(live, _ticket_equivalent(EQUIVALENT["state"]))["answers"]
    assert call.parsed_arguments.model_dump(mode="json") == argmax_answers(direct)  # type: ignore[union-attr]
    assert response.output_text == "" and response.to_dict()["tool_choice"] == tool_choice  # echoed


@pytest.mark.slow
def test_a_history_of_calls_and_their_outputs_is_part_of_the_state(sdk: openai.OpenAI, live: Live) -> None:
    lookup = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    first = sdk.responses.create(
        model="tiny", input=USER, tools=[lookup, TOOL], tool_choice={"type": "function", "name": "ticket"}
    )
    (earlier,) = first.output
    # An agent loop: the earlier output replayed as it came, a call, its output, then the forced tool.
    history: list[Any] = [
        {"role": "user", "content": USER},
        earlier.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": earlier.call_id, "output": "filed"},  # type: ignore[union-attr]
        {
            "type": "function_call",
            "call_id": "call_7",
            "name": "lookup",
            "arguments": json.dumps(LOOKUP_ARGUMENTS),
        },
        {"type": "function_call_output", "call_id": "call_7", "output": LOOKUP_OUTPUT},
    ]
    response = sdk.responses.create(
        model="tiny", input=history, tools=[lookup, TOOL], tool_choice={"type": "function", "name": "ticket"}
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "ticket"
    state = [
        {"role": "user", "content": USER},
        {
            "role": "assistant",
            "tool_calls": [{"name": "ticket", "arguments": json.loads(earlier.arguments)}],  # type: ignore[union-attr]
        },
        {"role": "tool", "content": "filed"},
        {"role": "assistant", "tool_calls": [{"name": "lookup", "arguments": LOOKUP_ARGUMENTS}]},
        {"role": "tool", "content": LOOKUP_OUTPUT},
    ]
    direct = systemone(live, {**EQUIVALENT, "state": state})
    assert json.loads(call.arguments) == argmax_answers(direct["answers"])  # type: ignore[union-attr]
    assert response.usage is not None and response.usage.input_tokens == direct["usage"]["input_tokens"]


def _refused(sdk: openai.OpenAI, **overrides: Any) -> openai.BadRequestError:
    body: dict[str, Any] = {"model": "tiny", "input": USER, "text": TEXT_FORMAT, **overrides}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(**body)
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"  # type: ignore[attr-defined]
    assert isinstance(info.value.body, dict) and set(info.value.body) == {"message", "type", "param", "code"}
    return info.value


@pytest.mark.slow
def test_bad_requests_are_openai_errors_naming_the_field(sdk: openai.OpenAI) -> None:
    undecidable = {
        "type": "object",
        "properties": {"team": SCHEMA["properties"]["team"], "note": {"type": "string"}},
    }
    error = _refused(sdk, text={"format": {**TEXT_FORMAT["format"], "schema": undecidable}})
    assert error.param == "text.format.schema.properties.note" and error.code == "unsupported_schema"
    assert "free string" in error.message
    error = _refused(sdk, tools=[{**TOOL, "parameters": undecidable}], tool_choice="required")
    assert error.param == "tools[0].parameters.properties.note"
    assert (
        _refused(sdk, tools=[TOOL, {**TOOL, "name": "other"}], tool_choice="required").param == "tool_choice"
    )
    assert _refused(sdk, tools=[{"type": "web_search"}], tool_choice="required").param == "tools[0].type"
    # With "auto" next to a text format the format is answered: the tools are not looked at.
    answered = sdk.responses.create(
        model="tiny", input=USER, text=TEXT_FORMAT, tools=[{"type": "web_search"}]
    )
    assert answered.output[0].type == "message"
    assert _refused(sdk, text={"format": {"type": "text"}}).param == "text.format"
    assert _refused(sdk, text={"format": {"type": "json_object"}}).code == "missing_schema"
    error = _refused(sdk, previous_response_id="resp_1")
    assert error.param == "previous_response_id" and "stores no responses" in error.message
    error = _refused(
        sdk,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": USER},
                    {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
                ],
            }
        ],
    )
    assert error.param == "input[0].content[1]" and error.code == "image_url_not_allowed"


@pytest.mark.slow
def test_responses_stream_parses_to_the_unstreamed_answer(sdk: openai.OpenAI) -> None:
    plain = sdk.responses.parse(model="tiny", instructions=SYSTEM, input=USER, text_format=Ticket)
    with sdk.responses.stream(model="tiny", instructions=SYSTEM, input=USER, text_format=Ticket) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == plain.output_text == "".join(deltas) and len(deltas) == 1
    assert isinstance(final.output_parsed, Ticket) and final.output_parsed == plain.output_parsed
    assert final.usage is not None and final.usage.input_tokens == plain.usage.input_tokens  # type: ignore[union-attr]


@pytest.mark.slow
def test_create_with_stream_sends_the_events_in_order_with_usage_last(sdk: openai.OpenAI) -> None:
    events = list(sdk.responses.create(model="tiny", input=USER, text=TEXT_FORMAT, stream=True))  # type: ignore[arg-type]
    assert [event.type for event in events] == MESSAGE_EVENTS
    assert [event.sequence_number for event in events] == list(range(len(MESSAGE_EVENTS)))
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.status == "completed"
    assert completed.response.usage is not None and completed.response.usage.input_tokens > 0
    assert completed.response.id == events[0].response.id  # type: ignore[union-attr]
    plain = sdk.responses.create(model="tiny", input=USER, text=TEXT_FORMAT)  # type: ignore[arg-type]
    assert completed.response.output_text == plain.output_text


@pytest.mark.slow
def test_a_forced_function_tool_streams_its_arguments_whole(sdk: openai.OpenAI, live: Live) -> None:
    request: dict[str, Any] = {
        "model": "tiny",
        "instructions": SYSTEM,
        "input": USER,
        "tools": [openai.pydantic_function_tool(Ticket)],
        "tool_choice": {"type": "function", "name": "Ticket"},
    }
    with sdk.responses.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds == CALL_EVENTS
    (call,) = final.output
    assert call.type == "function_call" and call.name == "Ticket"
    assert isinstance(call.parsed_arguments, Ticket)  # type: ignore[union-attr]
    direct = systemone(live, _ticket_equivalent(EQUIVALENT["state"]))["answers"]
    assert call.parsed_arguments.model_dump(mode="json") == argmax_answers(direct)  # type: ignore[union-attr]


@pytest.mark.slow
def test_the_api_key_is_required(live: Live) -> None:
    wrong = openai.OpenAI(api_key="nope", base_url=live.url + "/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.responses.create(model="tiny", input=USER, text=TEXT_FORMAT)  # type: ignore[arg-type]
    assert info.value.code == "invalid_api_key"
    bare = httpx.post(live.url + "/v1/responses", json={"model": "tiny", "input": USER, "text": TEXT_FORMAT})
    assert bare.status_code == 401 and set(bare.json()["error"]) == {"message", "type", "param", "code"}
