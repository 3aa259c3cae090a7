"""The MCP tool ``decide``: its definition (name, description, input and output schemas), the MCP server that
lists and calls it, and how answers and errors become tool results.

One definition for both transports: ``POST /mcp`` (`clef_runtime.server.mcp.http`, through the server's
decision flow) and ``clef mcp`` over stdio (`clef_runtime.mcp_command`, the engine in process). Each
passes only its way of deciding (`Decide`); what an agent sees (the schema, the description, the result and
every error's text) is written here once.

The tool's arguments are a System One request, so its input schema is the one the protocol models publish
(``SystemOneRequest`` plus the image fields), with descriptions written for agents. The SDK does not validate
arguments against it (the low-level ``Server`` passes them through): our own protocol code validates them, so
a bad body is a tool error naming the field (``invalid request: questions.q.type: ...``), as the HTTP routes
name it in a 422. Protocol facts used here (tool results, ``isError``, ``structuredContent``, tool
annotations): https://modelcontextprotocol.io/specification/2025-06-18/server/tools
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError
from pydantic import ValidationError

from clef_runtime.protocol.errors import ClefError, ErrorItem, RequestValidationError, format_loc
from clef_runtime.protocol.images import add_image_fields
from clef_runtime.protocol.systemone import (
    MAX_CHOICE_OPTIONS,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    MIN_CHOICE_OPTIONS,
    MIN_SCORE_LEVELS,
    SystemOneRequest,
    SystemOneResponse,
)
from clef_runtime.server.errors import ApiError
from clef_runtime.version import __version__

__all__ = [
    "DECIDE_TOOL",
    "SERVER_NAME",
    "TOOL_NAME",
    "Decide",
    "ToolSource",
    "malformed_message_error",
    "mcp_server",
]

logger = logging.getLogger("clef_runtime.server")

SERVER_NAME = "clef-runtime"
TOOL_NAME = "decide"

Decide = Callable[[dict[str, Any], ServerRequestContext[Any, Any]], Awaitable[dict[str, Any]]]
"""How a transport decides one request: ``(arguments, context) -> System One response``. Raises
`RequestValidationError`, `ApiError` or another `ClefError` for a request it refuses (each becomes a tool
error); anything else is an internal error."""


class ToolSource(Protocol):
    """Tools a transport offers besides ``decide``, which may differ from caller to caller (over HTTP: the
    caller's saved classifiers, `clef_runtime.server.mcp.classifiers`)."""

    instructions: str
    """What the ``initialize`` result's instructions say of these tools, after ``decide``: the same for
    every caller (the handshake lists no tools), so it names their pattern and says how to get them."""

    async def list_tools(self, ctx: ServerRequestContext[Any, Any]) -> list[types.Tool]:
        """The calling client's tools, in the order ``tools/list`` shows them."""
        ...

    def input_schema(self, name: str) -> dict[str, Any] | None:
        """The input schema of the tool ``name`` when it is one of this source's (None: it is not)."""
        ...

    async def call_tool(
        self, name: str, arguments: dict[str, Any], ctx: ServerRequestContext[Any, Any]
    ) -> dict[str, Any] | None:
        """Answer a call of the tool ``name``: its structured result, or None when the caller has no such
        tool. Raises as a `Decide` does for a call it refuses."""
        ...


_DESCRIPTION = f"""\
Answer typed questions about a state (text, JSON and/or images) with a Clef decision model: a probability \
for every option of every question, computed in one pass of the model, with no text generation. Use it to \
classify, route, moderate or judge something against criteria you write, when you want probabilities \
rather than prose.

Send a `state` and 1 to {MAX_QUESTIONS} `questions` keyed by an id of your choice. Question types:
- `noul` (yes/no): `{{"type": "noul", "instructions": "Is a refund requested?"}}` -> `{{"noul": P(true)}}`.
- `choice`: `criteria` maps {MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS} option ids to a description (or \
null) -> `choice` (the most probable option), its `confidence` and every option's `probabilities`.
- `score`: `criteria` lists {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} level descriptions, lowest first -> \
`score` (the expected level, 0-based), `confidence`, `legend` and `probabilities` per level.

The result is the System One response (`answers` keyed by your question ids, `usage`), as structured content \
and as JSON text. Probabilities are rounded to 4 decimals. An invalid request is a tool error naming the \
field (e.g. `invalid request: questions.q.criteria: ...`); fix that field and call again."""

_INSTRUCTIONS = (
    "This server runs a Clef decision model: it answers yes/no, choice and score questions about a state "
    "with probabilities, and never writes text."
)
_DECIDE_ONLY = "Its one tool, `decide`, answers the questions you send with the state."
_DECIDE_FIRST = "Its tools: `decide`, which answers the questions you send with the state."


def _instructions(more: ToolSource | None) -> str:
    """The ``initialize`` result's instructions: what the server does and the tools ``tools/list`` shows."""
    if more is None:
        return f"{_INSTRUCTIONS} {_DECIDE_ONLY}"
    return f"{_INSTRUCTIONS} {_DECIDE_FIRST} {more.instructions}"


# Agent-facing descriptions of the request's fields (the protocol models' own descriptions are written for
# the OpenAPI page and the code). Keyed by (definition, property); "" is the request itself.
_FIELD_DESCRIPTIONS: dict[tuple[str, str], str] = {
    ("", "state"): (
        "What to decide about: a string (used as is), or a JSON object or array (rendered as compact JSON "
        "with sorted keys). An array may also hold image parts ({'type': 'image_url', 'image_url': {'url': "
        "'data:image/png;base64,...'}} or {'type': 'input_image', 'image_url': 'data:...'}); what remains "
        "of the array is the text state."
    ),
    ("", "questions"): (
        f"1 to {MAX_QUESTIONS} questions keyed by an id of your choice (1-256 characters); the answers come "
        "back under the same ids. Each question is an object with 'type' ('noul', 'choice' or 'score'), "
        "optional 'instructions' and, for choice and score, 'criteria'."
    ),
    ("", "model"): (
        "Optional. Any model name is accepted (e.g. 'jev-latest'): the model the server runs answers, and "
        "the response's 'model' names it."
    ),
    ("", "images"): (
        "Optional images the model sees before the state: at most 4, PNG, JPEG or WebP, inline only (a "
        "'data:image/png;base64,...' URL or {'content_type': 'image/png', 'base64': '...'}); remote URLs "
        "are refused. 4 MiB each, 8 MiB together."
    ),
    ("NoulQuestion", "type"): "'noul': a yes/no question (or a statement to evaluate).",
    ("NoulQuestion", "criteria"): (
        "Optional descriptions of the two sides, {'true': '...', 'false': '...'}; either may be left out."
    ),
    ("ChoiceQuestion", "type"): "'choice': exactly one of the options in 'criteria'.",
    ("ChoiceQuestion", "criteria"): (
        f"{MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS} options: option id -> what it means (a string, JSON, "
        "or null for none). The answer's 'choice' is one of these ids."
    ),
    ("ScoreQuestion", "type"): "'score': one of ordered levels.",
    ("ScoreQuestion", "criteria"): (
        f"{MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} level descriptions, lowest first (an array, not an "
        "object). The answer's 'score' is the expected level, 0 for the first."
    ),
}
_QUESTION_DESCRIPTIONS = {
    "NoulQuestion": "A yes/no question; answered with 'noul', the probability of yes.",
    "ChoiceQuestion": (
        f"One of {MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS} options; answered with 'choice', 'confidence' "
        "and 'probabilities'."
    ),
    "ScoreQuestion": (
        f"One of {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} ordered levels; answered with 'score', "
        "'confidence', 'legend' and 'probabilities'."
    ),
}
_OUTPUT_DESCRIPTIONS: dict[tuple[str, str], str] = {
    ("", "model"): "The model that answered.",
    ("", "answers"): "One answer per question id of the request, in the request's order.",
    ("", "usage"): "Input tokens the model read (output_tokens is always 0: nothing is generated).",
}


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    """``node`` with every local ``$ref`` replaced by its definition (some agents' schema readers resolve no
    references), without the OpenAPI-only ``discriminator`` and pydantic's ``title`` keywords (noise to an
    agent)."""
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return _inline(definitions[ref.removeprefix("#/$defs/")], definitions)
    inlined: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            # Property names are the request's fields: keep them all, whatever they are called.
            inlined[key] = {name: _inline(prop, definitions) for name, prop in value.items()}
        elif key == "description" and isinstance(value, str):
            inlined[key] = value.replace("``", "`")  # the models' docstrings are reStructuredText
        elif key not in ("discriminator", "title"):
            inlined[key] = _inline(value, definitions)
    return inlined


def _describe(schema: dict[str, Any], definitions: dict[str, Any], texts: dict[tuple[str, str], str]) -> None:
    """Put ``texts`` on the properties they name (in place), the request's own (``""``) or a definition's."""
    for (owner, name), text in texts.items():
        target = schema if owner == "" else definitions[owner]
        target["properties"][name]["description"] = text


def _input_schema() -> dict[str, Any]:
    """The System One request's JSON schema (the protocol models', images included), self-contained, with
    descriptions for agents."""
    template = "#/$defs/{model}"
    schema = SystemOneRequest.model_json_schema(ref_template=template)
    definitions: dict[str, Any] = schema.pop("$defs", {})
    definitions.update(add_image_fields(schema, template))
    _describe(schema, definitions, _FIELD_DESCRIPTIONS)
    for name, text in _QUESTION_DESCRIPTIONS.items():
        definitions[name]["description"] = text
    schema["description"] = "A System One decision request. Unknown top-level fields are ignored."
    inlined: dict[str, Any] = _inline(schema, definitions)
    return inlined


def _output_schema() -> dict[str, Any]:
    """The System One response's JSON schema, self-contained; the server's ``x_`` extras are allowed."""
    schema = SystemOneResponse.model_json_schema(ref_template="#/$defs/{model}")
    definitions: dict[str, Any] = schema.pop("$defs", {})
    _describe(schema, definitions, _OUTPUT_DESCRIPTIONS)
    schema["description"] = (
        "The System One response. Extra fields start with x_: x_truncated_state_tokens (state tokens cut to "
        "fit the input limit), x_state_cache (hit / partial / miss), x_latency_ms (over HTTP); with "
        "x_explain, each answer's x_evidence and the body's x_explain (how the evidence was computed)."
    )
    inlined: dict[str, Any] = _inline(schema, definitions)
    return inlined


DECIDE_TOOL = types.Tool(
    name=TOOL_NAME,
    title="Decide with Clef",
    description=_DESCRIPTION,
    input_schema=_input_schema(),
    output_schema=_output_schema(),
    # Hints for clients: deciding reads nothing but the arguments and changes nothing.
    annotations=types.ToolAnnotations(
        title="Decide with Clef",
        read_only_hint=True,
        destructive_hint=False,
        idempotent_hint=True,
        open_world_hint=False,
    ),
)
"""The ``decide`` tool as ``tools/list`` lists it."""


def _decision_result(answer: dict[str, Any]) -> types.CallToolResult:
    """A successful call: the System One response as structured content and the same JSON as text (for
    clients that read only the text)."""
    text = json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
    return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=answer)


def _error_result(text: str) -> types.CallToolResult:
    """A refused call: ``isError`` with ``text``, which the agent reads to correct its call."""
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _invalid_request_text(errors: Sequence[ErrorItem]) -> str:
    """Every problem with the field it is in: ``invalid request: questions.q.type: ...; state: ...``."""
    return "invalid request: " + "; ".join(f"{format_loc(e['loc'])}: {e['msg']}" for e in errors)


def _error_text(exc: ApiError | ClefError) -> str:
    """What a tool error says for a refused request: the fields of an invalid one, else the error's type and
    its message (``rate_limited: ...; retry in 2 s``, ``not_ready: ...``)."""
    if isinstance(exc, RequestValidationError):
        return _invalid_request_text(exc.errors)
    if isinstance(exc, ApiError) and exc.validation is not None:
        return _invalid_request_text(exc.validation)
    return f"{exc.error_type}: {exc.message}"


def mcp_server(decide: Decide, more: ToolSource | None = None) -> Server[Any]:
    """An MCP server (the SDK's low-level ``Server``: our own schema and validation) whose tools are
    ``decide``, answered by ``decide``, and those of ``more`` (listed after it). Serve it over any
    transport."""

    async def list_tools(
        ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        extra = await more.list_tools(ctx) if more is not None else []
        return types.ListToolsResult(tools=[DECIDE_TOOL, *extra])

    async def dispatch(
        name: str, arguments: dict[str, Any], ctx: ServerRequestContext[Any, Any]
    ) -> dict[str, Any] | None:
        """The tool's answer, or None when the caller has no tool ``name``."""
        if name == TOOL_NAME:
            return await decide(arguments, ctx)
        return None if more is None else await more.call_tool(name, arguments, ctx)

    async def call_tool(
        ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            answer = await dispatch(params.name, dict(params.arguments or {}), ctx)
        except (ApiError, ClefError) as exc:
            return _error_result(_error_text(exc))
        except Exception:
            # The HTTP routes answer these with a 500 naming the request id; a tool call answers a tool error
            # (never an HTTP 5xx) and the traceback goes to the log.
            logger.exception("mcp tool call failed")
            return _error_result("internal_error: the server failed to answer this call; see its log")
        if answer is None:
            # An unknown tool is a protocol error, not a tool error (the spec's example).
            others = " and the tools tools/list shows" if more is not None else ""
            raise MCPError(
                types.INVALID_PARAMS, f"unknown tool {params.name!r}; this server has '{TOOL_NAME}'{others}"
            )
        return _decision_result(answer)

    def input_schema(name: str) -> dict[str, Any] | None:
        # Read by the SDK to check Mcp-Param-* headers (2026-07-28 HTTP) without listing the tools.
        if name == TOOL_NAME:
            return DECIDE_TOOL.input_schema
        return None if more is None else more.input_schema(name)

    return Server(
        SERVER_NAME,
        version=__version__,
        title="Clef decisions",
        instructions=_instructions(more),
        get_tool_input_schema=input_schema,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


# ----------------------------------------------------------------------------- malformed messages
# A message that is not JSON-RPC never reaches the server above: each transport answers it with the error
# below, the same for a stdio line and a POST body. The SDK's own text for it is pydantic's report on every
# branch of the message union (a dozen lines and URLs); this one names the field.

_MESSAGE_KINDS = ("JSONRPCRequest", "JSONRPCNotification", "JSONRPCResponse", "JSONRPCError")


def malformed_message_error(exc: ValidationError) -> types.ErrorData:
    """The JSON-RPC error for a message the SDK's message adapter refused (``exc``): -32700 for text that is
    not JSON, -32602 for ``params`` of the wrong type, else -32600 naming the field(s), e.g. ``invalid
    request: method: Field required``. Of the message kinds, the one the message is closest to (the fewest
    problems; a request before a notification, a response, an error) names them."""
    problems = exc.errors(include_url=False, include_input=False, include_context=False)
    for problem in problems:
        if problem["type"] == "json_invalid":
            reason = problem["msg"].removeprefix("Invalid JSON: ")
            return types.ErrorData(code=types.PARSE_ERROR, message=f"parse error: {reason}")
    by_kind: dict[str, list[tuple[tuple[str | int, ...], str]]] = {}
    for problem in problems:
        kind, *field = problem["loc"] or ("",)
        by_kind.setdefault(str(kind), []).append((tuple(field), problem["msg"]))
    closest = min((by_kind[kind] for kind in _MESSAGE_KINDS if kind in by_kind), key=len, default=[((), "")])
    if any(not field for field, _ in closest):  # the message itself: an array, a string, a number
        return types.ErrorData(
            code=types.INVALID_REQUEST, message="invalid request: a JSON-RPC message is a JSON object"
        )
    listed = "; ".join(f"{format_loc(field)}: {text}" for field, text in closest)
    if all(field[0] == "params" for field, _ in closest):
        return types.ErrorData(code=types.INVALID_PARAMS, message=f"invalid params: {listed}")
    return types.ErrorData(code=types.INVALID_REQUEST, message=f"invalid request: {listed}")
