"""The official ``openai`` SDK's function tools and its Responses API against the live server, the answers
compared with the equivalent /v1/systemone request (``response_format`` is in
tests/server/openai/test_openai_client.py): ``openai.pydantic_function_tool`` (strict) with every kind of
``tool_choice``, a streamed tool call (``chat.completions.stream`` and ``stream=True``),
``responses.parse(text_format=...)``, ``responses.create`` with a raw json_schema ``text.format``, and a
function tool on the Responses API."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.clients.common import KEY, MESSAGES, SYSTEM, USER, Mood, Ticket, check_ticket, last_call
from tests.live_server import Live

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
FORCED = {"type": "function", "function": {"name": "Ticket"}}


@pytest.fixture(scope="module")
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_a_strict_pydantic_function_tool_forced_by_name(client: openai.OpenAI, live: Live) -> None:
    since = len(live.exchanges)
    completion = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Ticket)], tool_choice=FORCED
    )
    exchange = last_call(live, CHAT, since)
    assert exchange.json()["tools"][0]["function"]["strict"] is True
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "Ticket" and call.id
    ticket = call.function.parsed_arguments
    assert isinstance(ticket, Ticket) and isinstance(ticket.mood, Mood)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


@pytest.mark.parametrize("tool_choice", ["required", "auto", None])
def test_the_only_tool_is_called_whatever_the_tool_choice(
    client: openai.OpenAI, live: Live, tool_choice: str | None
) -> None:
    since = len(live.exchanges)
    extra: dict[str, Any] = {} if tool_choice is None else {"tool_choice": tool_choice}
    completion = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[openai.pydantic_function_tool(Ticket)],
        parallel_tool_calls=False,
        **extra,
    )
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.function.name == "Ticket" and completion.choices[0].finish_reason == "tool_calls"
    ticket = Ticket.model_validate_json(call.function.arguments)
    check_ticket(live, last_call(live, CHAT, since), ticket.model_dump(mode="json"))


def test_a_streamed_tool_call(client: openai.OpenAI, live: Live) -> None:
    tools = [openai.pydantic_function_tool(Ticket)]
    since = len(live.exchanges)
    with client.chat.completions.stream(
        model="tiny",
        messages=MESSAGES,
        tools=tools,
        tool_choice=FORCED,
        stream_options={"include_usage": True},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    exchange = last_call(live, CHAT, since)
    assert exchange.headers["content-type"].startswith("text/event-stream"), exchange.describe()
    (call,) = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    ticket = call.function.parsed_arguments
    assert isinstance(ticket, Ticket)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))

    # The same call from a plain stream=True, its argument deltas joined as a client joins them.
    arguments: dict[int, str] = {}
    finish_reasons = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice=FORCED, stream=True
    ):
        for choice in chunk.choices:
            finish_reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert list(arguments) == [0] and "tool_calls" in finish_reasons
    assert json.loads(arguments[0]) == ticket.model_dump(mode="json")


def test_responses_parse_with_a_text_format(client: openai.OpenAI, live: Live) -> None:
    since = len(live.exchanges)
    response = client.responses.parse(model="tiny", instructions=SYSTEM, input=USER, text_format=Ticket)
    exchange = last_call(live, RESPONSES, since)
    ticket = response.output_parsed
    assert isinstance(ticket, Ticket)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


def test_responses_create_with_a_raw_json_schema(client: openai.OpenAI, live: Live) -> None:
    since = len(live.exchanges)
    response = client.responses.create(
        model="tiny",
        input=MESSAGES,
        text={
            "format": {
                "type": "json_schema",
                "name": "ticket",
                "schema": Ticket.model_json_schema(),
                "strict": False,
            }
        },
    )
    exchange = last_call(live, RESPONSES, since)
    assert response.status == "completed"
    check_ticket(live, exchange, json.loads(response.output_text))


@pytest.mark.parametrize("tool", [openai.pydantic_responses_function_tool, openai.pydantic_function_tool])
def test_responses_with_a_function_tool(client: openai.OpenAI, live: Live, tool: Any) -> None:
    since = len(live.exchanges)
    response = client.responses.parse(
        model="tiny",
        input=MESSAGES,
        tools=[tool(Ticket)],
        tool_choice={"type": "function", "name": "Ticket"},
    )
    exchange = last_call(live, RESPONSES, since)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "Ticket" and call.call_id
    ticket = call.parsed_arguments
    assert isinstance(ticket, Ticket)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))
