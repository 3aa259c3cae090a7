"""OpenAI structured outputs (``POST /v1/chat/completions`` with a JSON schema) as one Clef decision.

An application that classifies through OpenAI's Chat Completions with ``response_format`` (a raw
``json_schema``, or ``client.chat.completions.parse(response_format=PydanticModel)``) gets each field of its
schema decided in one prefill, with real probabilities instead of sampled tokens. Pure: no torch, no HTTP.

The request, field by field:

* ``messages`` -> the System One ``state`` as a message array ``[{"role", "content"}, ...]`` in order,
  system and developer messages included (the encoder renders it as compact JSON); a role other than
  Chat Completions' (`CHAT_ROLES`) is refused naming ``messages[i].role``. A string content is
  kept as is; a list of parts keeps its text (``text``, an assistant's ``refusal``): one text as a string,
  several as an array of strings. ``image_url`` parts (inline ``data:`` URLs) go to System One's top-level
  ``images`` list in message order, with System One's limits (4 images, 4 MiB each, 8 MiB together); a
  message left without text is omitted from the state (it only carried images). An assistant message's
  ``tool_calls`` (or legacy ``function_call``) are kept in its entry as ``tool_calls: [{name,
  arguments}]`` (arguments as JSON when they parse, call ids dropped), and ``role: "tool"`` messages are
  kept as any other message, so a client's retry with the failed call in its history and an agent's loop
  are decided on the whole conversation. Audio and file parts are refused.
* ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}`` -> one
  question per property of the root object, in the schema's order, the property name as the question id:

  - string ``enum`` (or integer ``enum``) -> ``choice`` over the values (option ids are the values as
    strings; the typed value is answered);
  - ``anyOf`` / ``oneOf`` of ``const`` branches -> ``choice``, each branch's ``description`` (or title) as
    its option's criterion;
  - ``boolean`` -> ``noul``;
  - ``integer`` with ``minimum`` / ``maximum`` (or the exclusive forms) spanning 2-10 values -> ``score``
    with one level per value, lowest first, each level described by its value;
  - the property's ``description`` (else its ``title``) -> ``instructions`` (else the name is used);
  - ``$ref`` to ``$defs`` / ``definitions`` (Pydantic v2 emits enums so, alone, with sibling keys, or
    wrapped in a one-element ``allOf``) is resolved, the property's own keys winning;
  - nullable fields (``anyOf`` with ``{"type": "null"}``, ``type: [..., "null"]``, ``null`` in an
    ``enum``), as Pydantic and openai's strict schema emit ``Optional`` fields, are decided over their
    non-null values: every property is answered, so the client's parser always finds every field.

  Anything else (free strings, numbers, nested objects, arrays, unbounded or too wide integers, a single
  allowed value) is refused with 400 naming the property.
* ``tools`` with one function tool to call (see :mod:`clef_runtime.protocol.openai_tools` for the rule:
  forced by name, or the only tool with ``tool_choice`` "required", "auto" or absent) -> the tool's
  ``parameters`` schema is decided exactly as a ``response_format`` schema; with both, the tool is
  called only when ``tool_choice`` is "required" or names it (with "auto" the schema is answered).
* ``n`` above 1, the legacy ``functions``, and a request without a decidable schema (no tool, and no
  ``response_format`` or a ``text`` / ``json_object`` one) are refused with 400. Sampling parameters
  (temperature, top_p, seed, max_tokens, ...) are accepted and ignored: nothing is sampled.

The reply is a ``chat.completion`` whose ``choices[0].message.content`` is the JSON object of the answers
(the chosen enum value, true/false, the most probable integer), ``finish_reason`` ``"stop"`` (for a tool:
``content`` null, ``tool_calls`` = one call of the tool with that object as its ``arguments``,
``finish_reason`` ``"tool_calls"``), usage with
``prompt_tokens`` = the input tokens and ``completion_tokens`` 0, and ``x_decisions`` = the System One
answers keyed by property (probabilities, confidence). A boolean is true when P(true) >= 0.5 and a score
the first most probable level, as the System One answer's probabilities show them.

With ``logprobs: true``, ``choices[0].logprobs.content`` holds one entry per field, in schema order (one
"token" per field, not tokenizer tokens: nothing is generated): ``token`` is the chosen value as JSON text
(``"billing"``, ``true``, ``3``), ``logprob`` its natural log probability, ``bytes`` its UTF-8 bytes,
``top_logprobs`` every allowed value of the field the same way, in the schema's order, and the extension
``x_field`` the property name. Log probabilities come from the 4-decimal probabilities of the answer; a
probability that rounds to 0 gets -9999.0 (OpenAI's value for "practically impossible").

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; ``param`` is the offending
field's path (``response_format.json_schema.schema.properties.summary``, ``messages[1].content[0]``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from clef_runtime.protocol.errors import ErrorItem, RequestValidationError, format_loc
from clef_runtime.protocol.openai_tools import chosen_function_tool, rendered_call
from clef_runtime.protocol.plain_errors import validate_object
from clef_runtime.protocol.systemone import (
    MAX_CHOICE_OPTIONS,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    MIN_CHOICE_OPTIONS,
    MIN_SCORE_LEVELS,
)

__all__ = [
    "CHAT_PARTS",
    "CHAT_ROLES",
    "SCHEMA_LOC",
    "ChatCompletionRequest",
    "ChatPlan",
    "FieldPlan",
    "PartKinds",
    "checked_role",
    "content_pieces",
    "field_logprobs",
    "openai_error_body",
    "parse_chat_request",
    "route_error_loc",
    "schema_questions",
    "to_chat_chunks",
    "to_chat_completion",
    "to_systemone",
    "translate_error_loc",
    "typed_answers",
]

SCHEMA_LOC: tuple[str, ...] = ("response_format", "json_schema", "schema")
"""Where the schema sits in the request (error locations start here)."""

IMPOSSIBLE_LOGPROB = -9999.0
_MAX_REF_DEPTH = 32
_SUPPORTED = (
    "use a string enum, anyOf/oneOf of const values, a boolean, or an integer with minimum and maximum "
    f"{MIN_SCORE_LEVELS}-{MAX_SCORE_LEVELS} values apart"
)


# ------------------------------------------------------------------------------------------ wire types


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: only ``json_schema`` can be decided."""

    model_config = ConfigDict(extra="ignore")
    type: str
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = None


class ChatCompletionRequest(BaseModel):
    """The fields of a Chat Completions request that matter here; every other field (sampling parameters,
    ``max_tokens``, ``user``, ``metadata``, ...) is accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None


def parse_chat_request(data: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body as a Chat Completions request (top-level types only; messages and the
    schema are checked by :func:`to_systemone`).

    Returns the request. Raises :class:`RequestValidationError` naming each bad field.
    """
    return validate_object(ChatCompletionRequest, data)


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class FieldPlan:
    """How one schema property became a System One question."""

    name: str
    kind: Literal["boolean", "choice", "integer"]
    values: tuple[tuple[str, Any], ...] = ()
    """choice: (option id, typed value) in schema order; integer: (level key "0".., integer value)."""


@dataclass(frozen=True)
class ChatPlan:
    """The mapping of one request, kept to build the reply and to locate errors."""

    fields: tuple[FieldPlan, ...]
    image_locs: tuple[tuple[str | int, ...], ...] = ()
    """Where each image of the System One ``images`` list came from (``("messages", i, "content", j)``)."""
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tool_name: str | None = None
    """The function tool whose call is the answer (None: the answers are the message content)."""
    schema_loc: tuple[str | int, ...] = SCHEMA_LOC
    """Where the decided schema sits in the request: ``response_format`` or the tool's ``parameters``."""


# ------------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class PartKinds:
    """The content-part types of one OpenAI API: Chat Completions' (`CHAT_PARTS`) or the Responses API's."""

    text: tuple[str, ...]
    """Parts whose ``text`` is kept."""
    image: str
    """The image part's type (its part goes to System One's ``images``)."""
    unsupported: tuple[str, ...]
    """Known part types that cannot be decided (refused as ``unsupported_part``)."""
    shape: str
    """How a valid part looks, for the error message."""


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The message roles of Chat Completions (``function``: the legacy function result)."""

CHAT_PARTS = PartKinds(
    text=("text",),
    image="image_url",
    unsupported=("input_audio", "file"),
    shape="{type: text, text} or {type: image_url, image_url: {url}}",
)


def content_pieces(
    content: Any,
    loc: tuple[str | int, ...],
    images: list[Any],
    image_locs: list[tuple[str | int, ...]],
    kinds: PartKinds = CHAT_PARTS,
) -> list[str]:
    """The texts of one message's content (a string, or parts of ``kinds``; an assistant's ``refusal``
    parts count as text); image parts are appended to ``images`` and their locations to ``image_locs``."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise RequestValidationError.single(loc, "content must be a string or an array of parts", "type")
    pieces: list[str] = []
    for j, part in enumerate(content):
        part_loc = (*loc, j)
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds.text and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            pieces.append(part["refusal"])
        elif kind == kinds.image:
            images.append(part)
            image_locs.append(part_loc)
        elif kind in kinds.unsupported:
            raise RequestValidationError.single(
                part_loc,
                f"{kind} parts are not supported; send {kinds.text[0]} and {kinds.image} parts",
                "unsupported_part",
            )
        else:
            raise RequestValidationError.single(
                part_loc, f"a content part must be {kinds.shape}", "invalid_part"
            )
    return pieces


def checked_role(role: Any, loc: tuple[str | int, ...], allowed: tuple[str, ...]) -> str:
    """A message's ``role``, which must be one of ``allowed`` (an unknown role would reach the model as a
    speaker it was never shown). Raises :class:`RequestValidationError` at ``loc`` listing them."""
    if not isinstance(role, str) or not role:
        raise RequestValidationError.single(loc, "a message needs a role", "missing")
    if role not in allowed:
        raise RequestValidationError.single(
            loc,
            f"role must be one of {', '.join(repr(r) for r in allowed)} (got {role!r})",
            "invalid_value",
        )
    return role


def _state_of(messages: list[Any]) -> tuple[list[dict[str, Any]] | str, list[Any], list[tuple]]:
    state: list[dict[str, Any]] = []
    images: list[Any] = []
    image_locs: list[tuple[str | int, ...]] = []
    for i, message in enumerate(messages):
        loc: tuple[str | int, ...] = ("messages", i)
        if not isinstance(message, dict):
            raise RequestValidationError.single(loc, "a message must be an object with a role", "type")
        role = checked_role(message.get("role"), (*loc, "role"), CHAT_ROLES)
        pieces = content_pieces(message.get("content"), (*loc, "content"), images, image_locs)
        calls = _calls_of(message, loc)
        if not pieces and not calls:
            continue
        entry: dict[str, Any] = {"role": role}
        if role == "function" and isinstance(message.get("name"), str):
            entry["name"] = message["name"]
        if pieces:
            entry["content"] = pieces[0] if len(pieces) == 1 else pieces
        if calls:
            entry["tool_calls"] = calls
        state.append(entry)
    return (state if state else ""), images, image_locs


def _calls_of(message: dict[str, Any], loc: tuple[str | int, ...]) -> list[dict[str, Any]]:
    """The tool calls an assistant message made (``tool_calls``, or the legacy ``function_call``)."""
    raw_calls = message.get("tool_calls")
    legacy = message.get("function_call")
    calls: list[tuple[Any, tuple[str | int, ...]]] = []
    if raw_calls is not None:
        if not isinstance(raw_calls, list):
            raise RequestValidationError.single((*loc, "tool_calls"), "tool_calls must be an array", "type")
        for k, call in enumerate(raw_calls):
            call_loc = (*loc, "tool_calls", k)
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise RequestValidationError.single(
                    call_loc, "a tool call must be {type: function, function: {name, arguments}}", "type"
                )
            calls.append((function, (*call_loc, "function")))
    if legacy is not None:
        calls.append((legacy, (*loc, "function_call")))
    rendered = []
    for function, function_loc in calls:
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestValidationError.single(
                (*function_loc, "name"), "a tool call needs a name", "missing"
            )
        rendered.append(rendered_call(name, function.get("arguments")))
    return rendered


# --------------------------------------------------------------------------------------------- schema


class _Undecidable(Exception):
    def __init__(self, loc: tuple[str | int, ...], msg: str, type_: str = "unsupported_schema") -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg
        self.type = type_


def _lookup(root: dict[str, Any], ref: Any, loc: tuple[str | int, ...]) -> dict[str, Any]:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise _Undecidable(loc, f"only local $ref values ('#/$defs/...') are supported, got {ref!r}")
    node: Any = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        key = raw.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            raise _Undecidable(loc, f"$ref {ref!r} does not resolve in the schema")
        node = node[key]
    if not isinstance(node, dict):
        raise _Undecidable(loc, f"$ref {ref!r} does not point at a schema object")
    return node


def _resolve(node: Any, root: dict[str, Any], loc: tuple[str | int, ...]) -> dict[str, Any]:
    """``node`` with its ``$ref`` and one-element ``allOf`` merged in (its own keys win)."""
    for _ in range(_MAX_REF_DEPTH):
        if not isinstance(node, dict):
            raise _Undecidable(loc, "the property's schema must be an object")
        if "$ref" in node:
            own = {k: v for k, v in node.items() if k != "$ref"}
            node = {**_lookup(root, node["$ref"], loc), **own}
        elif isinstance(node.get("allOf"), list) and len(node["allOf"]) == 1:
            own = {k: v for k, v in node.items() if k != "allOf"}
            inner = _resolve(node["allOf"][0], root, loc)
            node = {**inner, **own}
        else:
            return node
    raise _Undecidable(loc, "the $ref chain is too deep or cyclic")


def _is_null(branch: dict[str, Any]) -> bool:
    if branch.get("type") == "null":
        return True
    if "const" in branch and branch["const"] is None:
        return True
    return branch.get("enum") == [None]


def _text(node: dict[str, Any]) -> str | None:
    for key in ("description", "title"):
        value = node.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def _choice_of(
    name: str, values: list[Any], descriptions: list[str | None], loc: tuple[str | int, ...]
) -> tuple[dict[str, Any], FieldPlan]:
    if all(isinstance(v, bool) for v in values) and set(values) == {True, False} and len(values) == 2:
        return {"type": "noul"}, FieldPlan(name, "boolean")
    if not all(isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) for v in values):
        raise _Undecidable(loc, f"property {name!r}: enum values must be strings or integers; {_SUPPORTED}")
    keys = [v if isinstance(v, str) else str(v) for v in values]
    if len(set(keys)) != len(keys):
        raise _Undecidable(loc, f"property {name!r}: the allowed values repeat ({keys})")
    if not MIN_CHOICE_OPTIONS <= len(keys) <= MAX_CHOICE_OPTIONS:
        raise _Undecidable(
            loc,
            f"property {name!r} allows {len(keys)} value(s); a decision needs "
            f"{MIN_CHOICE_OPTIONS} to {MAX_CHOICE_OPTIONS}",
        )
    criteria = dict(zip(keys, descriptions, strict=True))
    return {"type": "choice", "criteria": criteria}, FieldPlan(
        name, "choice", tuple(zip(keys, values, strict=True))
    )


def _integer_bounds(node: dict[str, Any]) -> tuple[int | None, int | None]:
    def number(key: str) -> float | None:
        value = node.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return None

    low = high = None
    if (v := number("minimum")) is not None:
        low = math.ceil(v)
    if (v := number("exclusiveMinimum")) is not None:
        low = max(low, math.floor(v) + 1) if low is not None else math.floor(v) + 1
    if (v := number("maximum")) is not None:
        high = math.floor(v)
    if (v := number("exclusiveMaximum")) is not None:
        high = min(high, math.ceil(v) - 1) if high is not None else math.ceil(v) - 1
    return low, high


def _field_question(
    name: str, prop: Any, root: dict[str, Any], loc: tuple[str | int, ...]
) -> tuple[dict[str, Any], FieldPlan]:
    """The System One question (without instructions) and plan of one property."""
    node = _resolve(prop, root, loc)
    union = node.get("anyOf", node.get("oneOf"))
    if isinstance(union, list) and union:
        own = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
        branches = [_resolve(b, root, loc) for b in union]
        branches = [b for b in branches if not _is_null(b)]
        if len(branches) == 1:
            return _field_question(name, {**branches[0], **own}, root, loc)
        consts: list[Any] = []
        for branch in branches:
            if "const" in branch:
                consts.append(branch["const"])
            elif isinstance(branch.get("enum"), list) and len(branch["enum"]) == 1:
                consts.append(branch["enum"][0])
            else:
                raise _Undecidable(
                    loc, f"property {name!r}: anyOf/oneOf branches must each be one const value; {_SUPPORTED}"
                )
        return _choice_of(name, consts, [_text(b) for b in branches], loc)
    types = node.get("type")
    if isinstance(types, list):
        non_null = [t for t in types if t != "null"]
        types = non_null[0] if len(non_null) == 1 else non_null
    if "const" in node and node["const"] is not None:
        raise _Undecidable(loc, f"property {name!r} allows a single value; there is nothing to decide")
    if isinstance(node.get("enum"), list):
        values = [v for v in node["enum"] if v is not None]
        return _choice_of(name, values, [None] * len(values), loc)
    if types == "boolean":
        return {"type": "noul"}, FieldPlan(name, "boolean")
    if types == "integer":
        low, high = _integer_bounds(node)
        if low is None or high is None:
            raise _Undecidable(
                loc, f"property {name!r} is an integer without minimum and maximum; {_SUPPORTED}"
            )
        count = high - low + 1
        if not MIN_SCORE_LEVELS <= count <= MAX_SCORE_LEVELS:
            raise _Undecidable(
                loc,
                f"property {name!r} spans {max(count, 0)} integer value(s) ({low}..{high}); a score needs "
                f"{MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS}",
            )
        values = list(range(low, high + 1))
        levels = tuple((str(i), v) for i, v in enumerate(values))
        return {"type": "score", "criteria": [str(v) for v in values]}, FieldPlan(name, "integer", levels)
    what = {
        "string": "a free string",
        "number": "a number",
        "object": "a nested object",
        "array": "an array",
        "null": "always null",
    }.get(types if isinstance(types, str) else "", "of no decidable type")
    raise _Undecidable(loc, f"property {name!r} is {what} and cannot be decided; {_SUPPORTED}")


def schema_questions(
    schema: Any, loc: tuple[str | int, ...] = SCHEMA_LOC
) -> tuple[dict[str, Any], tuple[FieldPlan, ...]]:
    """Map a JSON schema (the root object) onto System One questions, one per property in order.

    ``loc``: where the schema sits in the request (a ``response_format``, a tool's ``parameters``).
    Returns ``(questions, fields)``. Raises :class:`RequestValidationError` whose locations start at
    ``loc``, naming the property that cannot be decided.
    """
    schema_loc = loc
    errors: list[ErrorItem] = []
    try:
        if not isinstance(schema, dict):
            raise _Undecidable(schema_loc, "the schema must be a JSON object")
        root = _resolve(schema, schema, schema_loc)
        properties = root.get("properties")
        if root.get("type", "object") != "object" or not isinstance(properties, dict) or not properties:
            raise _Undecidable(
                schema_loc, "the schema must be an object with at least one property to decide"
            )
        if len(properties) > MAX_QUESTIONS:
            raise _Undecidable(
                (*schema_loc, "properties"),
                f"the schema has {len(properties)} properties; at most {MAX_QUESTIONS} are decided at once",
            )
    except _Undecidable as exc:
        raise RequestValidationError.single(exc.loc, exc.msg, exc.type) from None
    questions: dict[str, Any] = {}
    fields: list[FieldPlan] = []
    for name, prop in properties.items():
        loc = (*schema_loc, "properties", name)
        try:
            question, field = _field_question(name, prop, schema, loc)
        except _Undecidable as exc:
            errors.append({"loc": exc.loc, "msg": exc.msg, "type": exc.type})
            continue
        resolved = _resolve(prop, schema, loc)
        instructions = _text(resolved)
        if instructions is not None:
            question["instructions"] = instructions
        questions[name] = question
        fields.append(field)
    if errors:
        raise RequestValidationError(errors)
    return questions, tuple(fields)


# ------------------------------------------------------------------------------------------ request


def to_systemone(request: ChatCompletionRequest) -> tuple[dict[str, Any], ChatPlan]:
    """Map a validated Chat Completions request onto a System One request body.

    Returns ``(systemone_body, plan)``. Raises :class:`RequestValidationError` (OpenAI-located) for
    ``n`` > 1, tools, a missing or undecidable schema, and unsupported message parts.
    """
    if request.n is not None and request.n != 1:
        raise RequestValidationError.single(
            ("n",), f"n must be 1: a decision has one answer (got {request.n})", "unsupported_value"
        )
    if request.functions:
        raise RequestValidationError.single(
            ("functions",),
            "the legacy functions parameter is not supported: send the function as tools[0] instead",
            "unsupported_tools",
        )
    fmt = request.response_format
    format_schema = fmt.json_schema.schema_ if fmt and fmt.type == "json_schema" and fmt.json_schema else None
    tool = chosen_function_tool(
        request.tools, request.tool_choice, nested=True, schema_given=format_schema is not None
    )
    if tool is not None:
        schema, schema_loc = tool.parameters, tool.parameters_loc
    elif format_schema is not None:
        schema, schema_loc = format_schema, SCHEMA_LOC
    else:
        given = "none" if fmt is None else repr(fmt.type)
        raise RequestValidationError.single(
            ("response_format",),
            "a decision needs response_format {type: 'json_schema', json_schema: {name, schema}}, or one "
            "function tool, whose properties are enums, booleans or bounded integers (got response_format "
            f"{given})",
            "missing_schema",
        )
    questions, fields = schema_questions(schema, schema_loc)
    state, images, image_locs = _state_of(request.messages)
    body: dict[str, Any] = {"state": state, "questions": questions}
    if images:
        body["images"] = images
    if request.model is not None:
        body["model"] = request.model
    plan = ChatPlan(
        fields=fields,
        image_locs=tuple(image_locs),
        model=request.model,
        stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        logprobs=bool(request.logprobs),
        tool_name=None if tool is None else tool.name,
        schema_loc=schema_loc,
    )
    return body, plan


def translate_error_loc(loc: tuple[Any, ...], plan: ChatPlan) -> tuple[Any, ...]:
    """The location in the chat request of an error found in the mapped System One request:
    ``questions.<name>...`` -> the schema property, ``images[k]`` -> its message part, ``state`` ->
    ``messages``."""
    return route_error_loc(
        loc, schema_loc=plan.schema_loc, image_locs=plan.image_locs, state_loc=("messages",)
    )


def route_error_loc(
    loc: tuple[Any, ...],
    *,
    schema_loc: tuple[str | int, ...],
    image_locs: tuple[tuple[str | int, ...], ...],
    state_loc: tuple[str | int, ...],
) -> tuple[Any, ...]:
    """Where an error found in a mapped System One request points in the OpenAI request it came from:
    ``questions.<name>...`` -> the property under ``schema_loc``, ``images[k]`` -> ``image_locs[k]``,
    ``state`` (and an image without a recorded origin) -> ``state_loc``; anything else as it is."""
    if not loc:
        return loc
    if loc[0] == "questions" and len(loc) >= 2:
        return (*schema_loc, "properties", loc[1])
    if loc[0] == "images" and len(loc) >= 2 and isinstance(loc[1], int) and loc[1] < len(image_locs):
        return image_locs[loc[1]]
    if loc[0] in ("state", "images"):
        return state_loc
    return loc


# ------------------------------------------------------------------------------------------- response


def typed_answers(answers: dict[str, Any], fields: tuple[FieldPlan, ...]) -> dict[str, Any]:
    """The JSON object of the answers, one typed value per field: the chosen enum value, true when
    P(true) >= 0.5, the first most probable integer."""
    out: dict[str, Any] = {}
    for field in fields:
        answer = answers[field.name]
        if field.kind == "boolean":
            out[field.name] = answer["noul"] >= 0.5
        elif field.kind == "choice":
            out[field.name] = dict(field.values)[answer["choice"]]
        else:
            probs = answer["probabilities"]
            best = max((key for key, _ in field.values), key=lambda k: probs[k])  # first maximum
            out[field.name] = dict(field.values)[best]
    return out


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else IMPOSSIBLE_LOGPROB


def _token(value: Any, p: float) -> dict[str, Any]:
    text = json.dumps(value, ensure_ascii=False)
    return {"token": text, "logprob": _logprob(p), "bytes": list(text.encode("utf-8"))}


def field_logprobs(
    answers: dict[str, Any], typed: dict[str, Any], fields: tuple[FieldPlan, ...]
) -> list[dict[str, Any]]:
    """One logprobs entry per field (see the module docstring): the chosen value, every allowed value."""
    content = []
    for field in fields:
        answer = answers[field.name]
        if field.kind == "boolean":
            p_true = float(answer["noul"])
            options = [(True, p_true), (False, 1.0 - p_true)]
        else:
            probs = answer["probabilities"]
            options = [(value, float(probs[key])) for key, value in field.values]
        chosen = typed[field.name]
        p_chosen = next(p for value, p in options if value == chosen and type(value) is type(chosen))
        entry = _token(chosen, p_chosen)
        entry["top_logprobs"] = [_token(value, p) for value, p in options]
        entry["x_field"] = field.name
        content.append(entry)
    return content


def _usage(systemone: dict[str, Any]) -> dict[str, Any]:
    usage = systemone.get("usage", {})
    prompt = int(usage.get("input_tokens", 0))
    cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": 0,
        "total_tokens": prompt,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def to_chat_completion(
    systemone: dict[str, Any], plan: ChatPlan, *, completion_id: str, created: int
) -> dict[str, Any]:
    """The ``chat.completion`` body for the engine's System One response ``systemone``.

    Returns the body (``x_decisions``: the System One answers; ``x_state_cache`` copied when present).
    Raises KeyError only for a malformed engine response (a server bug).
    """
    answers = systemone["answers"]
    typed = typed_answers(answers, plan.fields)
    arguments = json.dumps(typed, ensure_ascii=False)
    message: dict[str, Any] = {"role": "assistant", "content": arguments, "refusal": None}
    if plan.tool_name is not None:
        call_id = "call_" + completion_id.removeprefix("chatcmpl-")
        function = {"name": plan.tool_name, "arguments": arguments}
        message["content"] = None
        message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": systemone.get("model", plan.model or ""),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": (
                    {"content": field_logprobs(answers, typed, plan.fields), "refusal": None}
                    if plan.logprobs
                    else None
                ),
                "finish_reason": "stop" if plan.tool_name is None else "tool_calls",
            }
        ],
        "usage": _usage(systemone),
        "system_fingerprint": None,
        "x_decisions": answers,
    }
    if "x_state_cache" in systemone:
        body["x_state_cache"] = systemone["x_state_cache"]
    return body


def to_chat_chunks(completion: dict[str, Any], plan: ChatPlan) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed reply: one chunk with the whole content (and
    ``finish_reason`` "stop"), or for a tool call one chunk with the whole call and one with
    ``finish_reason`` "tool_calls"; then, with ``stream_options.include_usage``, a usage chunk with no
    choices.
    The caller sends each as an SSE ``data:`` event, then ``data: [DONE]``."""
    choice = completion["choices"][0]
    extras = {k: v for k, v in completion.items() if k.startswith("x_")}
    base = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
        "system_fingerprint": None,
    }
    message = choice["message"]
    if plan.tool_name is None:
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        finish_reason: str | None = "stop"
    else:
        # As OpenAI streams a call: its index, id, name and arguments first, the finish reason after.
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        delta, finish_reason = {"role": "assistant", "content": None, "tool_calls": calls}, None
    chunks = [
        {
            **base,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": finish_reason}
            ],
            "usage": None,
            **extras,
        }
    ]
    if finish_reason is None:
        chunks.append(
            {
                **base,
                "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}],
                "usage": None,
            }
        )
    if plan.include_usage:
        chunks.append({**base, "choices": [], "usage": completion["usage"]})
    return chunks


# ---------------------------------------------------------------------------------------------- errors


def openai_error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_param(loc: tuple[Any, ...]) -> str | None:
    """The ``param`` of an error at ``loc`` (``body`` dropped; None for the body itself)."""
    parts = tuple(loc[1:]) if loc[:1] == ("body",) else tuple(loc)
    return format_loc(parts) if parts else None
