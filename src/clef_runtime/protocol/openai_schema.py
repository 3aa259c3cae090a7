"""What the OpenAI mappings share: Chat Completions (:mod:`clef_runtime.protocol.openai_chat`) and the
Responses API (:mod:`clef_runtime.protocol.openai_responses`) decide the same JSON schemas the same way.

* a schema -> System One questions (:func:`schema_questions`, one question per property; the module
  docstring of :mod:`clef_runtime.protocol.openai_chat` lists what each property type becomes);
* message content parts -> state texts and System One ``images`` (:func:`content_pieces`, with the part
  types of each API as a :class:`PartKinds`), roles checked by :func:`checked_role`;
* the mapped System One body (:func:`decision_body`) and the plan both routes keep (:class:`DecisionPlan`);
* the answers -> typed values, their log probabilities, the usage counts;
* error locations (:func:`route_error_loc`) and OpenAI's error body.

Pure: no torch, no HTTP.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from clef_runtime.protocol.errors import ErrorItem, RequestValidationError, format_loc
from clef_runtime.protocol.explain import ExplainOptions, explain_wire
from clef_runtime.protocol.systemone import (
    MAX_CHOICE_OPTIONS,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    MIN_CHOICE_OPTIONS,
    MIN_SCORE_LEVELS,
)

__all__ = [
    "IMPOSSIBLE_LOGPROB",
    "SCHEMA_LOC",
    "DecisionPlan",
    "FieldPlan",
    "Loc",
    "PartKinds",
    "check_single_answer",
    "checked_role",
    "content_pieces",
    "decided_arguments",
    "decision_body",
    "error_param",
    "field_logprobs",
    "input_token_counts",
    "openai_error_body",
    "route_error_loc",
    "schema_questions",
    "typed_answers",
]

Loc = tuple[str | int, ...]

SCHEMA_LOC: Loc = ("response_format", "json_schema", "schema")
"""Where a Chat Completions ``response_format`` schema sits in the request (the default error location)."""

IMPOSSIBLE_LOGPROB = -9999.0
_MAX_REF_DEPTH = 32
_SUPPORTED = (
    "use a string enum, anyOf/oneOf of const values, a boolean, or an integer with minimum and maximum "
    f"{MIN_SCORE_LEVELS}-{MAX_SCORE_LEVELS} values apart"
)


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class FieldPlan:
    """How one schema property became a System One question."""

    name: str
    kind: Literal["boolean", "choice", "integer"]
    values: tuple[tuple[str, Any], ...] = ()
    """choice: (option id, typed value) in schema order; integer: (level key "0".., integer value)."""


@dataclass(frozen=True)
class DecisionPlan:
    """The mapping of one OpenAI request, kept to build the reply and to locate errors (each route's plan
    adds what only its reply needs)."""

    fields: tuple[FieldPlan, ...]
    schema_loc: Loc = SCHEMA_LOC
    """Where the decided schema sits in the request: the format's schema or the tool's ``parameters``."""
    image_locs: tuple[Loc, ...] = ()
    """Where each image of the System One ``images`` list came from (``("messages", i, "content", j)``)."""
    model: str | None = None
    tool_name: str | None = None
    """The function tool whose call is the answer (None: the answers are the message's text)."""
    logprobs: bool = False
    stream: bool = False


# ------------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class PartKinds:
    """The content-part types of one OpenAI API: Chat Completions' or the Responses API's."""

    text: tuple[str, ...]
    """Parts whose ``text`` is kept."""
    image: str
    """The image part's type (its part goes to System One's ``images``)."""
    unsupported: tuple[str, ...]
    """Known part types that cannot be decided (refused as ``unsupported_part``)."""
    shape: str
    """How a valid part looks, for the error message."""


def content_pieces(
    content: Any,
    loc: Loc,
    images: list[Any],
    image_locs: list[Loc],
    kinds: PartKinds,
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


def checked_role(role: Any, loc: Loc, allowed: tuple[str, ...]) -> str:
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


# --------------------------------------------------------------------------------------------- schema


class _Undecidable(Exception):
    def __init__(self, loc: Loc, msg: str, type_: str = "unsupported_schema") -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg
        self.type = type_


def _lookup(root: dict[str, Any], ref: Any, loc: Loc) -> dict[str, Any]:
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


def _resolve(node: Any, root: dict[str, Any], loc: Loc) -> dict[str, Any]:
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
    name: str, values: list[Any], descriptions: list[str | None], loc: Loc
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


def _field_question(name: str, prop: Any, root: dict[str, Any], loc: Loc) -> tuple[dict[str, Any], FieldPlan]:
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


def schema_questions(schema: Any, loc: Loc = SCHEMA_LOC) -> tuple[dict[str, Any], tuple[FieldPlan, ...]]:
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


# ------------------------------------------------------------------------------------------- request


def check_single_answer(n: int | None) -> None:
    """Refuse ``n`` above 1 (a decision has one answer). Raises :class:`RequestValidationError` at ``n``."""
    if n is not None and n != 1:
        raise RequestValidationError.single(
            ("n",), f"n must be 1: a decision has one answer (got {n})", "unsupported_value"
        )


def decision_body(
    questions: dict[str, Any],
    state: list[dict[str, Any]] | str,
    images: list[Any],
    model: str | None,
    explain: ExplainOptions | None = None,
) -> dict[str, Any]:
    """The System One request body of a mapped OpenAI request (``images``, ``model`` and ``x_explain`` only
    when given)."""
    body: dict[str, Any] = {"state": state, "questions": questions}
    if images:
        body["images"] = images
    if model is not None:
        body["model"] = model
    wire_explain = explain_wire(explain)
    if wire_explain is not None:
        body["x_explain"] = wire_explain
    return body


def decision_extras(systemone: dict[str, Any]) -> dict[str, Any]:
    """The engine's reports an OpenAI reply carries beside ``x_decisions``: ``x_state_cache`` and, with
    ``x_explain``, the explanation record (how the answers' ``x_evidence`` was computed), when present."""
    return {key: systemone[key] for key in ("x_state_cache", "x_explain") if key in systemone}


def route_error_loc(
    loc: tuple[Any, ...],
    *,
    schema_loc: Loc,
    image_locs: tuple[Loc, ...],
    state_loc: Loc,
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


def decided_arguments(
    systemone: dict[str, Any], fields: tuple[FieldPlan, ...]
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The engine's answers, their typed values and those values as the JSON text a reply carries."""
    answers = systemone["answers"]
    typed = typed_answers(answers, fields)
    return answers, typed, json.dumps(typed, ensure_ascii=False)


def input_token_counts(systemone: dict[str, Any]) -> tuple[int, int]:
    """The input tokens of the decision and how many of them came from the state cache."""
    usage = systemone.get("usage", {})
    prompt = int(usage.get("input_tokens", 0))
    cached = int((usage.get("input_tokens_details") or {}).get("cached_tokens", 0))
    return prompt, cached


# ---------------------------------------------------------------------------------------------- errors


def openai_error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_param(loc: tuple[Any, ...]) -> str | None:
    """The ``param`` of an error at ``loc`` (``body`` dropped; None for the body itself)."""
    parts = tuple(loc[1:]) if loc[:1] == ("body",) else tuple(loc)
    return format_loc(parts) if parts else None
