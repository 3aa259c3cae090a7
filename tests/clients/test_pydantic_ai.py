"""pydantic-ai against the live server (``OpenAIProvider(base_url=...)``): an Agent with
``output_type=Model`` (its default tool output: the tool ``final_result``, ``tool_choice`` required), with
``NativeOutput(Model)`` (``response_format`` json_schema), and on the Responses API
(``OpenAIResponsesModel``), each compared with the equivalent /v1/systemone request."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.clients.common import KEY, SYSTEM, USER, Ticket, check_ticket, last_call
from tests.live_server import Live

pytestmark = pytest.mark.slow


def provider(live: Live) -> OpenAIProvider:
    return OpenAIProvider(base_url=live.url + "/v1", api_key=KEY)


def run(model: Any, output_type: Any) -> Ticket:
    result = Agent(model, output_type=output_type, instructions=SYSTEM).run_sync(USER)
    assert isinstance(result.output, Ticket)
    return result.output


def test_default_tool_output(live: Live) -> None:
    since = len(live.exchanges)
    ticket = run(OpenAIChatModel("tiny", provider=provider(live)), Ticket)
    exchange = last_call(live, "/v1/chat/completions", since)
    body = exchange.json()
    assert [t["function"]["name"] for t in body["tools"]] == ["final_result"]
    assert body["tool_choice"] == "required"
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


def test_native_output(live: Live) -> None:
    since = len(live.exchanges)
    ticket = run(OpenAIChatModel("tiny", provider=provider(live)), NativeOutput(Ticket))
    exchange = last_call(live, "/v1/chat/completions", since)
    body = exchange.json()
    assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


def test_responses_model_tool_output(live: Live) -> None:
    since = len(live.exchanges)
    ticket = run(OpenAIResponsesModel("tiny", provider=provider(live)), Ticket)
    exchange = last_call(live, "/v1/responses", since)
    assert [t["name"] for t in exchange.json()["tools"]] == ["final_result"]
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


def test_responses_model_native_output(live: Live) -> None:
    since = len(live.exchanges)
    ticket = run(OpenAIResponsesModel("tiny", provider=provider(live)), NativeOutput(Ticket))
    exchange = last_call(live, "/v1/responses", since)
    assert exchange.json()["text"]["format"]["type"] == "json_schema"
    check_ticket(live, exchange, ticket.model_dump(mode="json"))
