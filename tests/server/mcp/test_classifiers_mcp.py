"""Saved classifiers as MCP tools over ``POST /mcp``, driven by the official ``mcp`` client against a live
loopback server (the fake engine): ``tools/list`` shows the caller's classifiers (and only theirs), a call
answers what ``POST /v1/classifiers/{name}/decide`` answers, a bad state is a tool error naming the field,
and each call is charged once against the caller's rate limit."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import mcp_types
import pytest
from devtools.fake_engine import FakeClef
from mcp.shared.exceptions import MCPError

from clef_runtime.jobs.classifier_store import Classifier
from clef_runtime.server.classifiers.service import NAME_MAX_CHARS
from clef_runtime.server.mcp.classifiers import TOOL_PREFIX, classifier_tool
from clef_runtime.server.mcp.tool import DECIDE_TOOL
from tests.server.conftest import LiveServer
from tests.server.mcp.test_mcp import ERAS, INITIALIZE, JSON_ACCEPT, connected, without_latency

QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Is a refund requested?"},
    "team": {"type": "choice", "criteria": {"billing": "charges, refunds", "tech": None}},
    "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
}
STATE = {"ticket": "Charged twice, please refund today."}


def save(url: str, name: str, key: str | None = None, **body: Any) -> dict[str, Any]:
    headers = {"x-api-key": key} if key else {}
    response = httpx.put(
        f"{url}/v1/classifiers/{name}", json={"questions": QUESTIONS, **body}, headers=headers, timeout=30
    )
    assert response.status_code in (200, 201), response.text
    saved: dict[str, Any] = response.json()
    return saved


def tools_of(url: str, era: str, key: str | None = None) -> list[mcp_types.Tool]:
    async def listing() -> list[mcp_types.Tool]:
        async with connected(url, era, key) as session:
            return (await session.list_tools()).tools

    return asyncio.run(listing())


def call(url: str, tool: str, arguments: dict[str, Any], era: str, key: str | None = None) -> Any:
    async def calling() -> Any:
        async with connected(url, era, key) as session:
            await session.list_tools()  # as agents do: the client then checks results against the schema
            return await session.call_tool(tool, arguments)

    return asyncio.run(calling())


def _leaves(group: BaseExceptionGroup[Any]) -> list[Any]:
    """The exceptions of a (nested) exception group."""
    leaves: list[Any] = []
    for exc in group.exceptions:
        leaves += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return leaves


def named_tools_match(instructions: str, tools: list[mcp_types.Tool]) -> bool:
    """Whether the tools the instructions name in backquotes (``decide``, or a pattern such as
    ``classify_<name>``) are those listed: each listed tool is named or fits a pattern, and each tool named
    by its full name is listed."""
    named = re.findall(r"`([a-z_]+(?:<name>)?)`", instructions)
    patterns = [re.compile(re.escape(name).replace("<name>", ".+")) for name in named]
    listed = {tool.name for tool in tools}
    return (
        all(any(p.fullmatch(name) for p in patterns) for name in listed)
        and {name for name in named if "<" not in name} <= listed
    )


def test_the_initialize_instructions_name_the_tools_that_tools_list_shows(
    live_fake: Callable[..., LiveServer],
) -> None:
    served = live_fake(FakeClef())

    def instructions() -> str:
        response = httpx.post(served.url + "/mcp", json=INITIALIZE, headers=JSON_ACCEPT, timeout=30)
        assert response.status_code == 200, response.text
        text: str = response.json()["result"]["instructions"]
        return text

    assert named_tools_match(instructions(), tools_of(served.url, "handshake"))  # decide alone
    save(served.url, "abuse")
    tools = tools_of(served.url, "handshake")
    assert [tool.name for tool in tools] == ["decide", TOOL_PREFIX + "abuse"]
    assert named_tools_match(instructions(), tools)


@pytest.mark.parametrize("era", ERAS)
def test_tools_list_shows_each_saved_classifier_after_decide(
    live_fake: Callable[..., LiveServer], era: str
) -> None:
    served = live_fake(FakeClef())
    assert [tool.name for tool in tools_of(served.url, era)] == ["decide"]
    save(served.url, "support-triage", description="Routes a support ticket to a team.")
    save(served.url, "abuse")
    decide, abuse, triage = tools_of(served.url, era)
    assert decide == DECIDE_TOOL
    assert (abuse.name, triage.name) == (TOOL_PREFIX + "abuse", TOOL_PREFIX + "support-triage")
    description = triage.description or ""
    assert description.startswith("Routes a support ticket to a team.")
    for text in (
        "`refund` (yes/no",
        "`team` (one of billing, tech)",
        "`urgency` (a score from 0 to 2",
        "version 1",
    ):
        assert text in description, text
    schema = triage.input_schema
    assert schema["required"] == ["state"]
    assert {"state", "images"} <= set(schema["properties"]) and not {"questions", "model"} & set(
        schema["properties"]
    )
    assert all(prop.get("description") for prop in schema["properties"].values())
    assert "$ref" not in json.dumps(schema)
    assert triage.annotations is not None and triage.annotations.read_only_hint
    assert served.engine.batches == []  # listing decides nothing


@pytest.mark.parametrize("era", ERAS)
def test_a_classifier_tool_answers_what_its_decide_route_answers(
    live_fake: Callable[..., LiveServer], era: str
) -> None:
    served = live_fake(FakeClef())
    save(served.url, "triage")
    result = call(served.url, TOOL_PREFIX + "triage", {"state": STATE}, era)
    assert not result.is_error, result.content
    answer = result.structured_content
    assert answer["x_classifier"] == {"name": "triage", "version": 1}
    assert json.loads(result.content[0].text) == answer
    route = httpx.post(f"{served.url}/v1/classifiers/triage/decide", json={"state": STATE}, timeout=30)
    assert without_latency(answer) == without_latency(route.json())
    assert len(served.engine.batches) == 2


def test_a_bad_state_is_a_tool_error_naming_the_field(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FakeClef())
    save(served.url, "triage")
    for arguments, field in (
        ({}, "state: "),
        ({"state": "s", "images": ["https://example.com/a.png"]}, "images[0]: "),
    ):
        result = call(served.url, TOOL_PREFIX + "triage", arguments, "handshake")
        assert result.is_error
        text = result.content[0].text
        assert text.startswith("invalid request: ") and field in text, text
    assert served.engine.batches == []


def test_another_keys_classifier_is_neither_listed_nor_callable(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(FakeClef(), api_keys=("alice:key-a", "bob:key-b"))
    save(served.url, "triage", key="key-a")
    assert [t.name for t in tools_of(served.url, "handshake", "key-a")] == ["decide", TOOL_PREFIX + "triage"]
    assert [t.name for t in tools_of(served.url, "handshake", "key-b")] == ["decide"]
    refusals: list[MCPError] = []
    try:
        call(served.url, TOOL_PREFIX + "triage", {"state": "s"}, "handshake", "key-b")
    except* MCPError as group:  # the client's error comes out of its task groups
        refusals = _leaves(group)
    assert refusals and all("unknown tool 'classify_triage'" in str(exc) for exc in refusals)
    assert served.engine.batches == []


@pytest.mark.parametrize("era", ERAS)
def test_each_classifier_tool_call_is_charged_once(live_fake: Callable[..., LiveServer], era: str) -> None:
    # A bucket of 3 that refills in 1,000 s: the save takes one, then two calls pass and the third is refused.
    served = live_fake(FakeClef(), api_keys=("k",), rate_limit=0.001, rate_burst=3)
    save(served.url, "triage", key="k")

    async def calls() -> list[mcp_types.CallToolResult]:
        results = []
        async with connected(served.url, era, "k") as session:
            for _ in range(3):  # listing is free, however often
                await session.list_tools()
            for _ in range(3):
                results.append(await session.call_tool(TOOL_PREFIX + "triage", {"state": "s"}))
        return results

    first, second, third = asyncio.run(calls())
    assert not first.is_error and not second.is_error
    assert third.is_error and third.content[0].text.startswith("rate_limited: ")
    assert len(served.engine.batches) == 2


def test_a_tool_name_and_description_stay_within_what_agents_accept() -> None:
    # The largest classifier there can be: the longest name, 64 questions of 255 long options.
    options = {f"option-{i:03d}-" + "x" * 200: None for i in range(255)}
    questions = {
        f"q{i}": {"type": "choice", "instructions": "y" * 5000, "criteria": options} for i in range(64)
    }
    biggest = Classifier("", "n" * NAME_MAX_CHARS, 7, questions, None, "z" * 2000, 0.0, 0.0)
    tool = classifier_tool(biggest)
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", tool.name)  # OpenAI's and Anthropic's tool-name rule
    assert tool.description is not None and len(tool.description) <= 6000
    assert "and 235 more" in tool.description  # each question's options are cut after 20
    assert "more question(s)" in tool.description  # and questions past the budget are counted, not cut
    assert tool.description.endswith("keyed by the question ids.")


def test_a_classifier_tool_with_a_broken_pin_is_a_tool_error_never_another_heads_answer(
    live_fake: Callable[..., LiveServer],
) -> None:
    engine = FakeClef()
    engine.load_head("billing", "/heads/billing")
    served = live_fake(engine)
    save(served.url, "triage", head="billing")
    engine.unload_head("billing")
    missing = call(served.url, TOOL_PREFIX + "triage", {"state": STATE}, "handshake")
    assert missing.is_error and "does not serve" in missing.content[0].text, missing.content[0].text
    engine.load_head("billing", "/heads/billing-v2")
    changed = call(served.url, TOOL_PREFIX + "triage", {"state": STATE}, "handshake")
    assert changed.is_error and "PUT /v1/classifiers/triage" in changed.content[0].text
    assert engine.batches == []
