"""What the client suites share: the ticket the clients classify (a Pydantic model with an enum, a Literal,
a boolean and a bounded integer), the same decision written by hand as System One questions, and the check
that a client's answer is the argmax of that System One request on the same live server.

The state of the equivalent request is the conversation the library actually sent (recorded by the live
server, see tests/live_server.py), rendered by the documented rule (README, "OpenAI and Workers AI
compatibility"): each chat message as ``{"role", "content"}`` with its text, an assistant's tool calls as
``tool_calls: [{"name", "arguments"}]`` with the arguments parsed, call ids dropped. Libraries add their own
messages (a retry's history, a system prompt), and the comparison must be on what was sent.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from tests.live_server import Exchange, Live, first_max, systemone

SYSTEM = "You route support tickets."
USER = "I was charged twice for my subscription and need this fixed today."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
KEY = "test-key"


class Mood(Enum):
    calm = "calm"
    annoyed = "annoyed"
    furious = "furious"


class Ticket(BaseModel):
    """A routed support ticket."""

    team: Literal["billing", "tech", "sales"] = Field(description="Which team handles it?")
    mood: Mood = Field(description="How does the customer feel?")
    refund: bool = Field(description="Is a refund requested?")
    urgency: int = Field(ge=1, le=3, description="How urgent, 1 to 3")


# Ticket's decision written by hand in System One (independent of the schema mapping under test).
QUESTIONS: dict[str, Any] = {
    "team": {
        "type": "choice",
        "instructions": "Which team handles it?",
        "criteria": {"billing": None, "tech": None, "sales": None},
    },
    "mood": {
        "type": "choice",
        "instructions": "How does the customer feel?",
        "criteria": {"calm": None, "annoyed": None, "furious": None},
    },
    "refund": {"type": "noul", "instructions": "Is a refund requested?"},
    "urgency": {"type": "score", "instructions": "How urgent, 1 to 3", "criteria": ["1", "2", "3"]},
}


def _text(content: Any) -> str | list[str] | None:
    if content is None or isinstance(content, str):
        return content
    texts = [p.get("text") or p.get("refusal") for p in content if p.get("type") in ("text", "refusal")]
    return texts[0] if len(texts) == 1 else (texts or None)


def _arguments(arguments: Any) -> Any:
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def chat_state(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The System One state of a Chat Completions conversation, by the documented rule."""
    state = []
    for message in messages:
        entry: dict[str, Any] = {"role": message["role"]}
        text = _text(message.get("content"))
        if text is not None:
            entry["content"] = text
        calls = [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
            for c in message.get("tool_calls") or []
        ]
        if calls:
            entry["tool_calls"] = calls
        if len(entry) > 1:
            state.append(entry)
    return state


def _input_text(content: Any) -> str | list[str] | None:
    if content is None or isinstance(content, str):
        return content
    kinds = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
    texts = [p[kinds[p["type"]]] for p in content if p.get("type") in kinds]
    return texts[0] if len(texts) == 1 else (texts or None)


def responses_state(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The System One state of a Responses API request, by the documented rule: ``instructions`` as a
    leading system message, a string ``input`` as a user message, message items as chat messages, a
    ``function_call`` item as an assistant's tool call (joined to the assistant turn just before it), a
    ``function_call_output`` item as a ``tool`` message, ``reasoning`` items left out."""
    state: list[dict[str, Any]] = []
    if body.get("instructions"):
        state.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            text = _input_text(item.get("content"))
            if text is not None:
                state.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"name": item["name"], "arguments": _arguments(item.get("arguments"))}
            if state and state[-1]["role"] == "assistant":
                state[-1].setdefault("tool_calls", []).append(call)
            else:
                state.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            state.append({"role": "tool", "content": item["output"]})
        else:
            assert kind == "reasoning", item
    return state


def state_of(exchange: Exchange) -> list[dict[str, Any]]:
    """The System One state of the conversation a recorded Chat Completions or Responses request sent."""
    body = exchange.json()
    return chat_state(body["messages"]) if "messages" in body else responses_state(body)


def argmax_ticket(answers: dict[str, Any]) -> dict[str, Any]:
    """The ticket System One's ``answers`` decide: each choice's and score's most probable value (the first
    one on a tie), and true when P(true) >= 0.5."""
    return {
        "team": first_max(answers["team"]["probabilities"]),
        "mood": first_max(answers["mood"]["probabilities"]),
        "refund": answers["refund"]["noul"] >= 0.5,
        "urgency": 1 + int(first_max(answers["urgency"]["probabilities"])),
    }


def decided(live: Live, state: Any) -> dict[str, Any]:
    """The System One response to the hand-written equivalent: ``state`` with Ticket's questions."""
    return systemone(live, {"state": state, "questions": QUESTIONS})


def check_ticket(live: Live, exchange: Exchange, ticket: dict[str, Any], state: Any = None) -> None:
    """``ticket`` (what the client returned, as JSON) is the argmax of the equivalent System One request,
    and the reply's ``x_decisions`` (in a stream: its first chunk's) carry that request's probabilities and
    its ``usage`` (where sent) its input tokens: the state and the questions were the same."""
    assert exchange.status == 200, exchange.describe()
    if state is None:
        state = state_of(exchange)
    direct = decided(live, state)
    assert ticket == argmax_ticket(direct["answers"]), exchange.describe()
    if exchange.headers.get("content-type", "").startswith("text/event-stream"):
        events = exchange.events()
        decisions = next(e["x_decisions"] for e in events if "x_decisions" in e)
        usages = [e["usage"] for e in events if e.get("usage")]
    else:
        reply = exchange.reply()
        decisions, usages = reply["x_decisions"], [reply["usage"]]
    for name in ("team", "mood", "urgency"):
        assert decisions[name]["probabilities"] == pytest.approx(
            direct["answers"][name]["probabilities"], abs=2e-4
        ), exchange.describe()
    assert decisions["refund"]["noul"] == pytest.approx(direct["answers"]["refund"]["noul"], abs=2e-4)
    for usage in usages:
        prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
        assert prompt_tokens == direct["usage"]["input_tokens"], exchange.describe()


def last_call(live: Live, path: str, since: int) -> Exchange:
    """The one request to ``path`` since index ``since`` of the server's exchanges."""
    calls = live.calls(path, since)
    assert len(calls) == 1, [c.describe() for c in calls]
    return calls[0]
