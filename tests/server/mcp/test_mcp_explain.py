"""``x_explain`` over MCP: the ``decide`` tool's and every ``classify_<name>`` tool's input schema offers it
(described for agents), a call passes it on to the engine, and the result carries the evidence (which the
client accepts against the tool's output schema)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from clef_runtime.protocol.explain import ExplainOptions
from clef_runtime.server.mcp.classifiers import TOOL_PREFIX
from tests.server.conftest import LiveServer
from tests.server.explaining_engine import FAKE_METHOD, ExplainingEngine
from tests.server.mcp.test_classifiers_mcp import STATE, call, save, tools_of
from tests.server.mcp.test_mcp import BODY, ERAS


@pytest.mark.parametrize("era", ERAS)
def test_the_decide_tool_passes_x_explain_on_and_returns_the_evidence(
    live_fake: Callable[..., LiveServer], era: str
) -> None:
    served = live_fake(ExplainingEngine())
    result = call(served.url, "decide", {**BODY, "x_explain": {"top_k": 2}}, era)
    assert not result.is_error, result.content
    assert served.engine.explained == [ExplainOptions(top_k=2)]  # type: ignore[attr-defined]
    answer = result.structured_content
    assert answer["x_explain"]["method"] == FAKE_METHOD
    assert all(1 <= len(a["x_evidence"]) <= 2 for a in answer["answers"].values())


def test_every_tool_offers_x_explain_and_a_classifier_tool_passes_it_on(
    live_fake: Callable[..., LiveServer],
) -> None:
    served = live_fake(ExplainingEngine())
    save(served.url, "triage")
    tools = tools_of(served.url, "per-request")
    assert {tool.name for tool in tools} == {"decide", TOOL_PREFIX + "triage"}
    for tool in tools:
        assert "x_evidence" in tool.input_schema["properties"]["x_explain"]["description"]
    result = call(served.url, TOOL_PREFIX + "triage", {"state": STATE, "x_explain": True}, "per-request")
    assert not result.is_error, result.content
    assert served.engine.explained == [ExplainOptions()]  # type: ignore[attr-defined]
    assert all(a["x_evidence"] for a in result.structured_content["answers"].values())


def test_a_bad_x_explain_is_a_tool_error_naming_the_field(live_fake: Callable[..., LiveServer]) -> None:
    served = live_fake(ExplainingEngine())
    result = call(served.url, "decide", {**BODY, "x_explain": {"top_k": 0}}, "per-request")
    assert result.is_error
    assert "x_explain.top_k" in result.content[0].text
    assert served.engine.explained == []  # type: ignore[attr-defined]
