"""Which function tool a request asks to be called: forced by name, the only one, or refused naming the
field, in Chat Completions' nested shape and the Responses API's flat one."""

from __future__ import annotations

from typing import Any

import pytest

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.openai_tools import chosen_function_tool

PARAMS = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


def nested(name: str, parameters: Any = PARAMS) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def flat(name: str, parameters: Any = PARAMS) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": parameters}


@pytest.mark.parametrize("choice", [None, "auto", "required"])
def test_the_only_tool_is_called_unless_the_choice_is_none(choice: Any) -> None:
    tool = chosen_function_tool([nested("final_result")], choice, nested=True)
    assert tool is not None and tool.name == "final_result" and tool.parameters == PARAMS
    assert tool.parameters_loc == ("tools", 0, "function", "parameters")
    assert chosen_function_tool([nested("final_result")], "none", nested=True, schema_given=True) is None
    assert chosen_function_tool(None, None, nested=True) is None
    assert chosen_function_tool([], "auto", nested=True) is None


def test_a_forced_choice_picks_its_tool_among_several_in_both_shapes() -> None:
    tools = [nested("a"), nested("b", {"type": "object", "properties": {"x": {"type": "boolean"}}})]
    tool = chosen_function_tool(tools, {"type": "function", "function": {"name": "b"}}, nested=True)
    assert (
        tool is not None
        and tool.name == "b"
        and tool.parameters_loc == ("tools", 1, "function", "parameters")
    )
    tool = chosen_function_tool([flat("a"), flat("b")], {"type": "function", "name": "b"}, nested=False)
    assert tool is not None and tool.name == "b" and tool.parameters_loc == ("tools", 1, "parameters")


def _refusal(tools: Any, choice: Any, *, is_nested: bool = True) -> dict[str, Any]:
    with pytest.raises(RequestValidationError) as info:
        chosen_function_tool(tools, choice, nested=is_nested)
    return info.value.errors[0]


@pytest.mark.parametrize(
    ("tools", "choice", "loc", "words"),
    [
        ([nested("a"), nested("b")], "required", ("tool_choice",), "2 tools were given"),
        ([nested("a"), nested("b")], None, ("tool_choice",), "does not name one"),
        (
            [nested("a")],
            {"type": "function", "function": {"name": "z"}},
            ("tool_choice", "function", "name"),
            "'z'",
        ),
        ([nested("a")], {"type": "function"}, ("tool_choice", "function", "name"), "must name"),
        ([nested("a")], {"type": "allowed_tools"}, ("tool_choice", "type"), "'allowed_tools'"),
        ([nested("a")], "sometimes", ("tool_choice",), "must be 'auto'"),
        ([{"type": "web_search"}], None, ("tools", 0, "type"), "only function tools"),
        (["f"], None, ("tools", 0), "must be an object"),
        ([{"type": "function"}], None, ("tools", 0, "function"), "function: {name, parameters}"),
        ([{"type": "function", "function": {}}], None, ("tools", 0, "function", "name"), "needs a name"),
        ([nested("a"), nested("a")], None, ("tools", 1, "function", "name"), "two tools are named 'a'"),
        ([nested("a", None)], None, ("tools", 0, "function", "parameters"), "parameters schema"),
        (None, "required", ("tool_choice",), "no tools were given"),
        (
            [nested("a")],
            "none",
            ("tool_choice",),
            "there is no json_schema response_format to answer instead",
        ),
        ([], {"type": "function", "function": {"name": "a"}}, ("tool_choice",), "no tools were given"),
    ],
)
def test_what_cannot_be_answered_is_refused_naming_the_field(
    tools: Any, choice: Any, loc: tuple[Any, ...], words: str
) -> None:
    error = _refusal(tools, choice)
    assert error["loc"] == loc and words in error["msg"]


def test_flat_tools_are_located_at_the_tool_itself() -> None:
    assert _refusal([flat("a", "x")], None, is_nested=False)["loc"] == ("tools", 0, "parameters")
    assert _refusal([flat("a")], {"type": "function"}, is_nested=False)["loc"] == ("tool_choice", "name")
