"""langchain-openai's ``ChatOpenAI`` against the live server (``base_url``): ``with_structured_output``
in its default method (``json_schema``: ``response_format``), with ``method="function_calling"`` (a
forced tool), and on the Responses API (``use_responses_api=True``), each compared with the equivalent
/v1/systemone request."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_openai import ChatOpenAI

from tests.clients.common import KEY, SYSTEM, USER, Ticket, check_ticket, last_call
from tests.live_server import Live

pytestmark = pytest.mark.slow

CONVERSATION = [("system", SYSTEM), ("human", USER)]


def model(live: Live, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(model="tiny", base_url=live.url + "/v1", api_key=KEY, max_retries=0, **options)


def test_with_structured_output_default_json_schema(live: Live) -> None:
    since = len(live.exchanges)
    ticket = model(live).with_structured_output(Ticket).invoke(CONVERSATION)
    exchange = last_call(live, "/v1/chat/completions", since)
    body = exchange.json()
    assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    assert isinstance(ticket, Ticket)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


def test_with_structured_output_function_calling(live: Live) -> None:
    since = len(live.exchanges)
    ticket = model(live).with_structured_output(Ticket, method="function_calling").invoke(CONVERSATION)
    exchange = last_call(live, "/v1/chat/completions", since)
    body = exchange.json()
    assert [t["function"]["name"] for t in body["tools"]] == ["Ticket"]
    assert isinstance(ticket, Ticket)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))


def test_with_structured_output_on_the_responses_api(live: Live) -> None:
    since = len(live.exchanges)
    ticket = model(live, use_responses_api=True).with_structured_output(Ticket).invoke(CONVERSATION)
    exchange = last_call(live, "/v1/responses", since)
    assert exchange.json()["text"]["format"]["type"] == "json_schema"
    assert isinstance(ticket, Ticket)
    check_ticket(live, exchange, ticket.model_dump(mode="json"))
