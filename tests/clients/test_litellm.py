"""litellm against the live server as an OpenAI-compatible endpoint (``model="openai/<name>"`` with
``api_base``): ``response_format=PydanticModel`` (its structured-output default) and a forced function
tool, each compared with the equivalent /v1/systemone request."""

from __future__ import annotations

import os

# litellm fetches its model cost map from GitHub at import unless told to use the copy it ships.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import pytest

from tests.clients.common import KEY, MESSAGES, Ticket, check_ticket, last_call
from tests.live_server import Live

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


def test_response_format_with_a_pydantic_model(live: Live) -> None:
    since = len(live.exchanges)
    response = litellm.completion(
        model="openai/tiny", api_base=live.url + "/v1", api_key=KEY, messages=MESSAGES, response_format=Ticket
    )
    exchange = last_call(live, CHAT, since)
    assert exchange.json()["response_format"]["type"] == "json_schema"
    assert response.choices[0].finish_reason == "stop"
    ticket = Ticket.model_validate_json(response.choices[0].message.content)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


def test_a_forced_function_tool(live: Live) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "route_ticket",
            "description": "Route a support ticket.",
            "parameters": Ticket.model_json_schema(),
        },
    }
    since = len(live.exchanges)
    response = litellm.completion(
        model="openai/tiny",
        api_base=live.url + "/v1",
        api_key=KEY,
        messages=MESSAGES,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "route_ticket"}},
    )
    exchange = last_call(live, CHAT, since)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "route_ticket" and call.id
    ticket = Ticket.model_validate_json(call.function.arguments)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))
