"""instructor 1.17.0 against the live server, from its own pinned environment (it needs openai<=3.3; see
tests/clients/envs.py): Mode.TOOLS (its default), TOOLS_STRICT, JSON_SCHEMA and RESPONSES_TOOLS, and its
retry path, where a validator refuses the first answer and instructor re-asks with the assistant's tool
call and a ``role: "tool"`` message in the history. Each answer is compared with the equivalent
/v1/systemone request on the conversation instructor sent."""

from __future__ import annotations

import json

import pytest

from tests.clients.common import KEY, check_ticket, last_call
from tests.clients.envs import run_json
from tests.live_server import Live

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
PINNED = {"instructor": "1.17.0", "openai": "3.3.0"}


def run_instructor(live: Live, mode: str) -> dict:
    out = run_json("instructor", "instructor_client.py", mode, live.url + "/v1", KEY)
    assert out["versions"] == PINNED
    return out


@pytest.mark.parametrize("mode", ["tools", "tools_strict", "json_schema", "responses_tools"])
def test_each_mode_answers_the_argmax_of_system_one(live: Live, mode: str) -> None:
    since = len(live.exchanges)
    out = run_instructor(live, mode)
    exchange = last_call(live, RESPONSES if mode == "responses_tools" else CHAT, since)
    body = exchange.json()
    if mode == "json_schema":
        assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    elif mode == "responses_tools":
        assert [t["name"] for t in body["tools"]] == ["Ticket"]
        assert body["tool_choice"] == {"type": "function", "name": "Ticket"}
    else:
        (tool,) = body["tools"]
        assert tool["function"]["name"] == "Ticket"
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Ticket"}}
        # instructor 1.17.0 maps Mode.TOOLS_STRICT onto Mode.TOOLS (deprecated): the same request, not strict.
        assert "strict" not in tool["function"]
    check_ticket(live, exchange, out["ticket"])


def test_a_refused_answer_is_asked_again_with_the_failed_call_in_the_history(live: Live) -> None:
    since = len(live.exchanges)
    out = run_instructor(live, "retry")
    assert out["validations"] == 2  # refused once, accepted on the second answer
    first, second = live.calls(CHAT, since)
    (first_call,) = first.reply()["choices"][0]["message"]["tool_calls"]
    assert first_call["function"]["name"] == "RetriedTicket"
    check_ticket(live, first, json.loads(first_call["function"]["arguments"]))

    history = second.json()["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool"], second.describe()
    (sent_back,) = history[2]["tool_calls"]
    assert sent_back["id"] == first_call["id"] and history[3]["tool_call_id"] == first_call["id"]
    assert json.loads(sent_back["function"]["arguments"]) == json.loads(first_call["function"]["arguments"])
    assert "check the team again" in history[3]["content"]
    # The second answer is decided on the whole conversation, the failed call and its error included.
    check_ticket(live, second, out["ticket"])


def test_a_refused_answer_on_the_responses_api_is_asked_again(live: Live) -> None:
    since = len(live.exchanges)
    out = run_instructor(live, "responses_retry")
    assert out["validations"] == 2
    first, second = live.calls(RESPONSES, since)
    (first_call,) = [item for item in first.reply()["output"] if item["type"] == "function_call"]
    assert first_call["name"] == "RetriedTicket"
    check_ticket(live, first, json.loads(first_call["arguments"]))
    # RESPONSES_TOOLS asks again with the validation error as a user message after the first input.
    items = second.json()["input"]
    assert items[: len(first.json()["input"])] == first.json()["input"], second.describe()
    assert items[-1]["role"] == "user" and "check the team again" in items[-1]["content"]
    check_ticket(live, second, out["ticket"])
