"""OpenAI function tools as a decision: which tool a request asks to be called, and where its schema is.

Clients such as instructor (``Mode.TOOLS``), pydantic-ai (its default tool output) and LangChain
(``method="function_calling"``) send their output schema as the ``parameters`` of one function tool and
force the model to call it. A decision answers that call: the tool's ``parameters`` schema is mapped onto
questions exactly as a ``response_format`` schema is, and the reply is one call of that tool whose
arguments are the answers. Pure: no torch, no HTTP.

The rule for picking the tool, the same on Chat Completions and on the Responses API:

* no ``tools`` (or an empty list), or ``tool_choice: "none"``: no tool is called (the request's
  ``response_format`` / ``text.format`` schema is decided instead; ``"none"`` with tools and no such
  schema is refused naming ``tool_choice``: nothing would be left to answer through);
* ``tool_choice`` ``"auto"`` or absent while the request also has a json_schema format: no tool is called
  either. "auto" lets the model answer instead of calling, and a decision's answer is that schema (an
  agent that offers tools next to its structured output, as pydantic-ai's ``NativeOutput`` with tools
  does, gets its output, not a call of one of its tools with decided arguments);
* ``tool_choice`` naming a function: that function (it must be among ``tools``);
* ``tool_choice`` ``"required"``, ``"auto"`` or absent: the only function tool; with several, the request
  is refused with 400 naming ``tool_choice``: a decision answers one schema, so the client must name it.

Every tool must be a function tool with a ``parameters`` object; other tool types (built-in search,
custom grammar tools) are refused naming the tool, and so is a Chat Completions-shaped tool (``function:
{name, parameters}``) sent to the Responses API, whose function tools are flat. ``parallel_tool_calls``
is accepted: exactly one call is made whatever its value. ``strict`` (true, false or absent) changes
nothing: every property is answered with one of its allowed values either way.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from clef_runtime.protocol.errors import RequestValidationError

__all__ = ["FunctionTool", "chosen_function_tool", "rendered_call"]

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class FunctionTool:
    """The function tool a request asks to be called."""

    name: str
    parameters: dict[str, Any]
    parameters_loc: Loc
    """Where ``parameters`` sits in the request (errors in the schema are located under it)."""


def _function_of(tool: Any, loc: Loc, nested: bool) -> tuple[dict[str, Any], Loc]:
    """The object holding a tool's ``name`` and ``parameters`` (``tool.function`` on Chat Completions,
    the tool itself on the Responses API), and its location."""
    if not isinstance(tool, dict):
        raise RequestValidationError.single(loc, "a tool must be an object", "type")
    kind = tool.get("type")
    if kind != "function":
        raise RequestValidationError.single(
            (*loc, "type"),
            f"only function tools can be answered (got type {kind!r}); a decision fills one function's "
            "parameters",
            "unsupported_tool",
        )
    if not nested:
        if isinstance(tool.get("function"), dict) and "name" not in tool:
            # Chat Completions' shape sent to the Responses API: say so, not "needs a name".
            raise RequestValidationError.single(
                loc,
                "Responses API function tools are flat: {type: 'function', name, parameters}; this tool has "
                "Chat Completions' shape {type: 'function', function: {name, parameters}}: move name and "
                "parameters up out of function",
                "invalid_tool_shape",
            )
        return tool, loc
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RequestValidationError.single(
            (*loc, "function"), "a function tool needs function: {name, parameters}", "missing"
        )
    return function, (*loc, "function")


def _named(tools: list[Any], nested: bool) -> dict[str, tuple[dict[str, Any], Loc]]:
    named: dict[str, tuple[dict[str, Any], Loc]] = {}
    for i, tool in enumerate(tools):
        function, loc = _function_of(tool, ("tools", i), nested)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestValidationError.single((*loc, "name"), "a function tool needs a name", "missing")
        if name in named:
            raise RequestValidationError.single(
                (*loc, "name"), f"two tools are named {name!r}", "duplicate_tool"
            )
        named[name] = (function, loc)
    return named


def _forced_name(tool_choice: dict[str, Any], nested: bool) -> str:
    kind = tool_choice.get("type")
    if kind != "function":
        raise RequestValidationError.single(
            ("tool_choice", "type"),
            f"tool_choice must be 'auto', 'required', 'none' or a function by name (got type {kind!r})",
            "unsupported_value",
        )
    holder = tool_choice.get("function") if nested else tool_choice
    loc: Loc = ("tool_choice", "function", "name") if nested else ("tool_choice", "name")
    name = holder.get("name") if isinstance(holder, dict) else None
    if not nested and name is None and isinstance(tool_choice.get("function"), dict):
        raise RequestValidationError.single(
            ("tool_choice",),
            "the Responses API names the function flat: tool_choice {type: 'function', name}; this is Chat "
            "Completions' {type: 'function', function: {name}}",
            "invalid_tool_shape",
        )
    if not isinstance(name, str) or not name:
        raise RequestValidationError.single(loc, "tool_choice must name the function to call", "missing")
    return name


def chosen_function_tool(
    tools: list[Any] | None, tool_choice: Any, *, nested: bool, schema_given: bool = False
) -> FunctionTool | None:
    """The function tool to answer (the module docstring gives the rule), or None when no tool is called.

    ``nested``: Chat Completions' shape (``{"type": "function", "function": {name, parameters}}``) when
    true, the Responses API's flat one (``{"type": "function", name, parameters}``) when false.
    ``schema_given``: the request also has a json_schema format to answer.
    Raises :class:`RequestValidationError` naming the field: a tool that is not a function (or not in the
    API's shape), a forced name that is not among the tools, several tools and no forced choice, a missing
    ``parameters``, ``tool_choice: "none"`` with tools and no schema to answer instead.
    """
    if tool_choice == "none" and tools and not schema_given:
        fmt = "response_format" if nested else "text.format"
        raise RequestValidationError.single(
            ("tool_choice",),
            f"tool_choice is 'none', so the tools cannot be called, and there is no json_schema {fmt} to "
            f"answer instead: a decision is answered through one function tool or a json_schema {fmt}; "
            f"send tool_choice 'required' (or name the tool) to have it called, or a json_schema {fmt}",
            "unsupported_value",
        )
    if tool_choice == "none" or not tools:
        if isinstance(tool_choice, dict) or tool_choice in ("required",):
            raise RequestValidationError.single(
                ("tool_choice",), "tool_choice asks for a tool call but no tools were given", "missing_tools"
            )
        return None
    if schema_given and tool_choice in (None, "auto"):
        return None
    named = _named(tools, nested)
    if isinstance(tool_choice, dict):
        name = _forced_name(tool_choice, nested)
        if name not in named:
            loc: Loc = ("tool_choice", "function", "name") if nested else ("tool_choice", "name")
            raise RequestValidationError.single(
                loc,
                f"tool_choice names {name!r}, which is not among the tools ({sorted(named)})",
                "unknown_tool",
            )
    elif tool_choice is None or tool_choice in ("auto", "required"):
        if len(named) != 1:
            raise RequestValidationError.single(
                ("tool_choice",),
                f"{len(named)} tools were given and tool_choice does not name one: a decision fills one "
                "function's parameters, so force it with tool_choice {type: 'function', ...name}",
                "ambiguous_tool",
            )
        (name,) = named
    else:
        raise RequestValidationError.single(
            ("tool_choice",),
            "tool_choice must be 'auto', 'required', 'none' or a function by name",
            "unsupported_value",
        )
    function, loc = named[name]
    parameters = function.get("parameters")
    if not isinstance(parameters, dict):
        raise RequestValidationError.single(
            (*loc, "parameters"),
            "the tool needs a parameters schema: an object whose properties are enums, booleans or bounded "
            "integers",
            "missing_schema",
        )
    return FunctionTool(name=name, parameters=parameters, parameters_loc=(*loc, "parameters"))


def rendered_call(name: str, arguments: Any) -> dict[str, Any]:
    """A tool call as the state shows it: its name and arguments, the arguments as JSON when they parse
    (a client's retry sends back the arguments it was given) and as the sent text otherwise. Call ids are
    left out: they are random per reply and would make identical conversations differ."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return {"name": name, "arguments": arguments}
