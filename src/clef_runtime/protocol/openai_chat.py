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
answers keyed by property (probabilities, confidence; with the top-level extension ``x_explain``, each
answer's ``x_evidence``, and the body's ``x_explain`` beside it says how it was computed). A boolean is
true when P(true) >= 0.5 and a score the first most probable level, as the System One answer's
probabilities show them.

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

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.explain import EXPLAIN_DESCRIPTION, ExplainField
from clef_runtime.protocol.openai_schema import (
    SCHEMA_LOC,
    DecisionPlan,
    Loc,
    PartKinds,
    check_single_answer,
    checked_role,
    content_pieces,
    decided_arguments,
    decision_body,
    decision_extras,
    error_param,
    field_logprobs,
    input_token_counts,
    openai_error_body,
    route_error_loc,
    schema_questions,
)
from clef_runtime.protocol.openai_tools import chosen_function_tool, rendered_call
from clef_runtime.protocol.plain_errors import validate_object

__all__ = [
    "CHAT_PARTS",
    "CHAT_ROLES",
    "SCHEMA_LOC",
    "ChatCompletionRequest",
    "ChatPlan",
    "error_param",
    "openai_error_body",
    "parse_chat_request",
    "schema_questions",
    "to_chat_chunks",
    "to_chat_completion",
    "to_systemone",
    "translate_error_loc",
]


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
    x_explain: ExplainField = Field(default=None, description=EXPLAIN_DESCRIPTION)


def parse_chat_request(data: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body as a Chat Completions request (top-level types only; messages and the
    schema are checked by :func:`to_systemone`).

    Returns the request. Raises :class:`RequestValidationError` naming each bad field.
    """
    return validate_object(ChatCompletionRequest, data)


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class ChatPlan(DecisionPlan):
    """The mapping of one Chat Completions request, kept to build the reply and to locate errors."""

    include_usage: bool = False
    """``stream_options.include_usage``: a streamed reply ends with a usage chunk."""


# ------------------------------------------------------------------------------------------- messages


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The message roles of Chat Completions (``function``: the legacy function result)."""

CHAT_PARTS = PartKinds(
    text=("text",),
    image="image_url",
    unsupported=("input_audio", "file"),
    shape="{type: text, text} or {type: image_url, image_url: {url}}",
)


def _state_of(messages: list[Any]) -> tuple[list[dict[str, Any]] | str, list[Any], list[Loc]]:
    state: list[dict[str, Any]] = []
    images: list[Any] = []
    image_locs: list[Loc] = []
    for i, message in enumerate(messages):
        loc: Loc = ("messages", i)
        if not isinstance(message, dict):
            raise RequestValidationError.single(loc, "a message must be an object with a role", "type")
        role = checked_role(message.get("role"), (*loc, "role"), CHAT_ROLES)
        pieces = content_pieces(message.get("content"), (*loc, "content"), images, image_locs, CHAT_PARTS)
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


def _calls_of(message: dict[str, Any], loc: Loc) -> list[dict[str, Any]]:
    """The tool calls an assistant message made (``tool_calls``, or the legacy ``function_call``)."""
    raw_calls = message.get("tool_calls")
    legacy = message.get("function_call")
    calls: list[tuple[Any, Loc]] = []
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


# ------------------------------------------------------------------------------------------ request


def to_systemone(request: ChatCompletionRequest) -> tuple[dict[str, Any], ChatPlan]:
    """Map a validated Chat Completions request onto a System One request body.

    Returns ``(systemone_body, plan)``. Raises :class:`RequestValidationError` (OpenAI-located) for
    ``n`` > 1, tools, a missing or undecidable schema, and unsupported message parts.
    """
    check_single_answer(request.n)
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
    body = decision_body(questions, state, images, request.model, request.x_explain)
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


# ------------------------------------------------------------------------------------------- response


def _usage(systemone: dict[str, Any]) -> dict[str, Any]:
    prompt, cached = input_token_counts(systemone)
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

    Returns the body (``x_decisions``: the System One answers; ``x_state_cache`` and ``x_explain``
    copied when present).
    Raises KeyError only for a malformed engine response (a server bug).
    """
    answers, typed, arguments = decided_arguments(systemone, plan.fields)
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
    body.update(decision_extras(systemone))
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
