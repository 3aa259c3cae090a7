"""OpenAI's Responses API (``POST /v1/responses``) with a JSON schema or a function tool as one decision.

The Responses API (https://platform.openai.com/docs/api-reference/responses/create) is the successor of
Chat Completions: ``input`` instead of ``messages``, ``text.format`` instead of ``response_format``, flat
function tools, and a Response object whose ``output`` is a list of items. ``client.responses.parse(
text_format=PydanticModel)`` and ``responses.create`` with a ``json_schema`` format or a function tool get
each property of the schema decided in one prefill, exactly as :mod:`clef_runtime.protocol.openai_chat`
decides a ``response_format`` (the same :func:`~clef_runtime.protocol.openai_schema.schema_questions`). Pure:
no torch, no HTTP.

The request, field by field:

* ``instructions`` -> a leading ``{"role": "system", "content": ...}`` message of the state.
* ``input`` -> the rest of the System One ``state``, a message array as chat's ``messages`` become (so the
  same conversation sent to either route is the same state, and the same decision):

  - a string -> one ``{"role": "user", "content": ...}`` message;
  - a message item (``type: "message"`` or no type; ``role`` one of ``system``, ``developer``, ``user``,
    ``assistant``, and ``content``): a string content is kept, a list of parts keeps its texts
    (``input_text``, ``output_text``, an assistant's ``refusal``; one text as a string, several as an
    array), ``input_image`` parts (inline ``data:`` URLs) go to System One's ``images`` with its limits (4
    images, 4 MiB each, 8 MiB together), and a message left without text is omitted; ``input_file`` and
    ``input_audio`` parts are refused;
  - a ``function_call`` item -> ``{"role": "assistant", "tool_calls": [{"name", "arguments"}]}``
    (arguments as JSON when they parse; call ids dropped, as chat drops them), merged into the assistant
    message or call just before it, as chat holds one turn's text and calls in one message;
  - a ``function_call_output`` item -> ``{"role": "tool", "content": <its output>}``;
  - ``reasoning`` items (a reasoning model's earlier turns, replayed by agent loops) are left out: they
    are another model's private notes, often encrypted;
  - ``item_reference`` (a stored item) and every other item type (built-in tool calls) are refused
    naming the item.
* ``text.format`` ``{"type": "json_schema", "name", "schema", "strict"?, "description"?}`` -> one question
  per property (errors located at ``text.format.schema.properties.<name>``). ``text`` and ``json_object``
  formats (or none) are refused unless a function tool is called: a decision needs a schema to decide.
* ``tools`` + ``tool_choice``: the flat function tool shape ``{"type": "function", "name", "parameters",
  "strict"?}``, picked by :func:`~clef_runtime.protocol.openai_tools.chosen_function_tool` (forced by
  name, or the only tool with ``"required"``, ``"auto"`` or no choice); ``tool_choice`` ``{"type":
  "allowed_tools", "mode", "tools": [one function]}`` forces that function. With a json_schema
  ``text.format`` as well, a tool is called only when forced or ``"required"`` (``"auto"`` answers the
  format); a called tool's ``parameters`` are decided (errors at ``tools[i].parameters.properties.<name>``).
* ``stream: true``: the same Response object sent as the Responses event stream (`to_response_events`).
* Refused with 400 naming the field, because they cannot be honoured: ``previous_response_id``,
  ``conversation`` and ``prompt`` (they refer to state stored by OpenAI; nothing is stored here: send the
  whole conversation in ``input``), ``background: true`` (nothing to poll), ``n`` above 1.
* Accepted and ignored (they change nothing about a decision): ``store`` (nothing is stored either way),
  ``parallel_tool_calls`` (exactly one call is made), ``include`` (except ``message.output_text.logprobs``),
  sampling parameters, ``max_output_tokens``, ``top_logprobs``, ``reasoning``, ``truncation``,
  ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ...

The reply is a Response object (https://platform.openai.com/docs/api-reference/responses/object):
``id`` ``resp_<request id>``, ``object: "response"``, ``status: "completed"``, ``output`` holding one item:

* a ``message`` (``msg_<request id>``) with one ``output_text`` part whose ``text`` is the JSON object of
  the answers (what ``responses.parse`` reads into ``output_parsed``), ``annotations: []`` and
  ``logprobs``: one entry per field (:func:`~clef_runtime.protocol.openai_schema.field_logprobs`) when
  ``include`` has ``message.output_text.logprobs``, else empty;
* or, for a tool, a ``function_call`` (``fc_<request id>``, ``call_id`` ``call_<request id>``) whose
  ``arguments`` are that JSON object.

``output_text`` is not sent: it is a convenience of OpenAI's SDKs, computed from ``output``. ``usage`` has
``input_tokens`` (``input_tokens_details.cached_tokens`` from the state cache) and 0 output tokens;
``instructions``, ``tools``, ``tool_choice``, ``text``, ``parallel_tool_calls``, ``metadata``,
``temperature``, ``top_p``, ``max_output_tokens`` and ``user`` are echoed (OpenAI's defaults where not
sent); ``store`` is false and ``previous_response_id`` null; ``x_decisions`` has the System One answers
(with the top-level extension ``x_explain``, each carries its ``x_evidence``; the body's ``x_explain`` beside
it says how they were computed).
Errors use OpenAI's shape, ``param`` naming the field (``text.format.schema.properties.summary``,
``input[2].content[1]``).

Streamed (https://platform.openai.com/docs/api-reference/responses-streaming), the decision is made whole
first, then sent as the events OpenAI sends, each with its ``sequence_number`` (0, 1, ...):
``response.created`` and ``response.in_progress`` (the Response without output or usage, ``status:
"in_progress"``), ``response.output_item.added`` (the item, empty and in progress), then for a message
``response.content_part.added``, the whole text as one ``response.output_text.delta`` (with the logprobs),
``response.output_text.done`` and ``response.content_part.done``, or for a function call the whole
arguments as one ``response.function_call_arguments.delta`` and ``response.function_call_arguments.done``;
then ``response.output_item.done`` (the finished item) and ``response.completed``, whose ``response`` is
the Response object as it is sent unstreamed (usage and ``x_`` extras included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from pydantic.json_schema import JsonDict

from clef_runtime.protocol import openai_schema
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.explain import EXPLAIN_DESCRIPTION, ExplainField
from clef_runtime.protocol.openai_schema import DecisionPlan, Loc, PartKinds
from clef_runtime.protocol.openai_tools import chosen_function_tool, rendered_call
from clef_runtime.protocol.plain_errors import validate_object

__all__ = [
    "LOGPROBS_INCLUDE",
    "TEXT_SCHEMA_LOC",
    "ResponsesPlan",
    "ResponsesRequest",
    "parse_responses_request",
    "to_response",
    "to_response_events",
    "to_systemone",
    "translate_error_loc",
]

TEXT_SCHEMA_LOC: Loc = ("text", "format", "schema")
"""Where a ``json_schema`` text format's schema sits in the request (error locations start here)."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` value that asks for the output text's log probabilities."""

_INPUT_DOC: JsonDict = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}


# ------------------------------------------------------------------------------------------ wire types


class TextFormat(BaseModel):
    """``text.format``: only ``json_schema`` can be decided (``text`` and ``json_object`` have no schema)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    """``text``: its ``format`` (``verbosity`` is accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """The fields of a Responses API request that matter here; every other field (``reasoning``,
    ``truncation``, ``service_tier``, ``prompt_cache_key``, ...) is accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: Any = Field(
        description="a string (one user message) or an array of input items",
        json_schema_extra=_INPUT_DOC,
    )
    instructions: str | None = None
    text: TextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    background: StrictBool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    n: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    user: str | None = None
    x_explain: ExplainField = Field(default=None, description=EXPLAIN_DESCRIPTION)


def parse_responses_request(data: Any) -> ResponsesRequest:
    """Validate a decoded JSON body as a Responses API request (top-level types only; ``input`` and the
    schema are checked by :func:`to_systemone`).

    Returns the request. Raises :class:`RequestValidationError` naming each bad field.
    """
    return validate_object(ResponsesRequest, data)


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class ResponsesPlan(DecisionPlan):
    """The mapping of one Responses API request, kept to build the reply and to locate errors (``stream``:
    the Response object is sent as the Responses event stream, `to_response_events`; image locations are
    ``("input", i, "content", j)``)."""

    echo: dict[str, Any] = field(default_factory=dict)
    """The request's fields that the Response object repeats, with OpenAI's defaults where not sent."""


# ---------------------------------------------------------------------------------------------- input


def _refuse(loc: Loc, msg: str, type_: str) -> RequestValidationError:
    return RequestValidationError.single(loc, msg, type_)


RESPONSES_ROLES = ("system", "developer", "user", "assistant")
"""The roles of a Responses API message item (tool results are ``function_call_output`` items)."""

RESPONSES_PARTS = PartKinds(
    text=("input_text", "output_text"),
    image="input_image",
    unsupported=("input_file", "input_audio"),
    shape="{type: input_text, text}, {type: output_text, text} or {type: input_image, image_url: 'data:...'}",
)


def _pieces(content: Any, loc: Loc, images: list[Any], image_locs: list[Loc]) -> list[str]:
    """The texts of a message's content (or a function call's output); image parts go to ``images``."""
    return openai_schema.content_pieces(content, loc, images, image_locs, RESPONSES_PARTS)


def _call(item: dict[str, Any], loc: Loc) -> dict[str, Any]:
    """A ``function_call`` item as the state shows a call: its name, and its arguments as JSON when they
    parse (the call id is left out: it differs on every reply)."""
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise _refuse((*loc, "name"), "a function_call item needs a name", "missing")
    return rendered_call(name, item.get("arguments"))


def _state_of(request: ResponsesRequest) -> tuple[list[dict[str, Any]] | str, list[Any], list[Loc]]:
    """The state (a message array), the images and where each image came from."""
    state: list[dict[str, Any]] = []
    images: list[Any] = []
    image_locs: list[Loc] = []
    if request.instructions:
        state.append({"role": "system", "content": request.instructions})
    items = request.input
    if isinstance(items, str):
        state.append({"role": "user", "content": items})
        return state, images, image_locs
    if not isinstance(items, list) or not items:
        raise _refuse(
            ("input",),
            "input must be a string or a non-empty array of input items",
            "missing" if items is None else "type",
        )
    turn: dict[str, Any] | None = None  # the assistant entry the previous item made (calls join it)
    for i, item in enumerate(items):
        loc: Loc = ("input", i)
        if not isinstance(item, dict):
            raise _refuse(loc, "an input item must be an object (a message or a function call)", "type")
        kind = item.get("type") or "message"
        entry: dict[str, Any] | None = None
        if kind == "message":
            role = openai_schema.checked_role(item.get("role"), (*loc, "role"), RESPONSES_ROLES)
            pieces = _pieces(item.get("content"), (*loc, "content"), images, image_locs)
            if pieces:
                entry = {"role": role, "content": pieces[0] if len(pieces) == 1 else pieces}
        elif kind == "function_call":
            call = _call(item, loc)
            if turn is not None:
                turn.setdefault("tool_calls", []).append(call)
                continue
            entry = {"role": "assistant", "tool_calls": [call]}
        elif kind == "function_call_output":
            if "output" not in item:
                raise _refuse((*loc, "output"), "a function_call_output item needs its output", "missing")
            pieces = _pieces(item["output"], (*loc, "output"), images, image_locs)
            entry = {
                "role": "tool",
                "content": "" if not pieces else pieces[0] if len(pieces) == 1 else pieces,
            }
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise _refuse(
                (*loc, "type"),
                "item references point at items stored by OpenAI; nothing is stored here: send the item "
                "itself",
                "unsupported_item",
            )
        else:
            raise _refuse(
                (*loc, "type"),
                f"input items of type {kind!r} are not supported; send messages, function_call and "
                "function_call_output items",
                "unsupported_item",
            )
        if entry is not None:
            state.append(entry)
        turn = entry if entry is not None and entry["role"] == "assistant" else None
    return (state if state else ""), images, image_locs


# ------------------------------------------------------------------------------------------- request


def _unsupported(request: ResponsesRequest) -> None:
    """Refuse what cannot be honoured, naming the field."""
    openai_schema.check_single_answer(request.n)
    stored = (
        ("previous_response_id", request.previous_response_id),
        ("conversation", request.conversation),
        ("prompt", request.prompt),
    )
    for name, value in stored:
        if value is not None:
            raise _refuse(
                (name,),
                f"{name} refers to state stored by OpenAI; this server stores no responses, conversations or "
                "prompts: send the whole conversation in input (and instructions)",
                "unsupported_parameter",
            )
    if request.background:
        raise _refuse(
            ("background",),
            "background must be false: responses are not stored, so there would be nothing to poll; a "
            "decision is answered at once",
            "unsupported_parameter",
        )


def _tool_choice(tool_choice: Any) -> Any:
    """``tool_choice`` with ``allowed_tools`` of one function turned into that function by name (a decision
    always calls it); other values as they are."""
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools"):
        return tool_choice
    allowed = tool_choice.get("tools")
    if not isinstance(allowed, list) or len(allowed) != 1:
        raise _refuse(
            ("tool_choice", "tools"),
            "allowed_tools must list exactly one function: a decision fills one function's parameters",
            "ambiguous_tool",
        )
    (only,) = allowed
    if not (isinstance(only, dict) and only.get("type") == "function" and isinstance(only.get("name"), str)):
        raise _refuse(
            ("tool_choice", "tools", 0),
            "an allowed tool must be {type: 'function', name}",
            "unsupported_tool",
        )
    return {"type": "function", "name": only["name"]}


def _echo(request: ResponsesRequest) -> dict[str, Any]:
    """The fields the Response object repeats, with OpenAI's defaults for what was not sent."""
    text: dict[str, Any] = {"format": {"type": "text"}}
    if request.text is not None and request.text.format is not None:
        text = {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)}
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata if request.metadata is not None else {},
        "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        "temperature": request.temperature,
        "text": text,
        "tool_choice": "auto" if request.tool_choice is None else request.tool_choice,
        "tools": request.tools or [],
        "top_p": request.top_p,
        "user": request.user,
    }


def to_systemone(request: ResponsesRequest) -> tuple[dict[str, Any], ResponsesPlan]:
    """Map a validated Responses API request onto a System One request body.

    Returns ``(systemone_body, plan)``. Raises :class:`RequestValidationError` located in the Responses
    request: what cannot be honoured (module docstring), a missing or undecidable schema, bad input items.
    """
    _unsupported(request)
    fmt = request.text.format if request.text is not None else None
    tool = chosen_function_tool(
        request.tools,
        _tool_choice(request.tool_choice),
        nested=False,
        schema_given=fmt is not None and fmt.type == "json_schema",
    )
    if tool is not None:
        schema, schema_loc = tool.parameters, tool.parameters_loc
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise _refuse(
                (*TEXT_SCHEMA_LOC,),
                "a json_schema text format needs its schema: an object whose properties are enums, booleans "
                "or bounded integers",
                "missing_schema",
            )
        schema, schema_loc = fmt.schema_, TEXT_SCHEMA_LOC
    else:
        given = "none" if fmt is None else repr(fmt.type)
        raise _refuse(
            ("text", "format"),
            "a decision needs text.format {type: 'json_schema', name, schema}, or one function tool, whose "
            f"properties are enums, booleans or bounded integers (got text.format {given}; a text or "
            "json_object format has no schema to decide)",
            "missing_schema",
        )
    questions, fields = openai_schema.schema_questions(schema, schema_loc)
    state, images, image_locs = _state_of(request)
    body = openai_schema.decision_body(questions, state, images, request.model, request.x_explain)
    plan = ResponsesPlan(
        fields=fields,
        schema_loc=schema_loc,
        image_locs=tuple(image_locs),
        model=request.model,
        tool_name=None if tool is None else tool.name,
        logprobs=LOGPROBS_INCLUDE in (request.include or ()),
        stream=bool(request.stream),
        echo=_echo(request),
    )
    return body, plan


def translate_error_loc(loc: tuple[Any, ...], plan: ResponsesPlan) -> tuple[Any, ...]:
    """The location in the Responses request of an error found in the mapped System One request:
    ``questions.<name>...`` -> the schema property, ``images[k]`` -> its input part, ``state`` ->
    ``input``."""
    return openai_schema.route_error_loc(
        loc, schema_loc=plan.schema_loc, image_locs=plan.image_locs, state_loc=("input",)
    )


# ------------------------------------------------------------------------------------------- response


def _usage(systemone: dict[str, Any]) -> dict[str, Any]:
    prompt, cached = openai_schema.input_token_counts(systemone)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt,
    }


def to_response(
    systemone: dict[str, Any], plan: ResponsesPlan, *, request_id: str, created: int
) -> dict[str, Any]:
    """The Response object for the engine's System One response ``systemone`` (module docstring).

    Returns the body (``x_decisions``: the System One answers; ``x_state_cache`` and ``x_explain``
    copied when present).
    Raises KeyError only for a malformed engine response (a server bug).
    """
    answers, typed, arguments = openai_schema.decided_arguments(systemone, plan.fields)
    item: dict[str, Any]
    if plan.tool_name is None:
        logprobs = openai_schema.field_logprobs(answers, typed, plan.fields) if plan.logprobs else []
        text = {"type": "output_text", "text": arguments, "annotations": [], "logprobs": logprobs}
        item = {
            "type": "message",
            "id": f"msg_{request_id}",
            "role": "assistant",
            "status": "completed",
            "content": [text],
        }
    else:
        item = {
            "type": "function_call",
            "id": f"fc_{request_id}",
            "call_id": f"call_{request_id}",
            "name": plan.tool_name,
            "arguments": arguments,
            "status": "completed",
        }
    body: dict[str, Any] = {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": created,
        "completed_at": created,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "model": systemone.get("model", plan.model or ""),
        "output": [item],
        "previous_response_id": None,
        "store": False,
        **plan.echo,
        "usage": _usage(systemone),
        "x_decisions": answers,
    }
    body.update(openai_schema.decision_extras(systemone))
    return body


# --------------------------------------------------------------------------------------------- stream


def _in_progress(response: dict[str, Any]) -> dict[str, Any]:
    """The Response as ``response.created`` / ``response.in_progress`` show it: no output, no usage, not
    completed, without the ``x_`` extras and ``latency_ms`` (they describe the finished decision)."""
    lifecycle = {k: v for k, v in response.items() if not k.startswith("x_") and k != "latency_ms"}
    return {**lifecycle, "status": "in_progress", "completed_at": None, "output": [], "usage": None}


def _message_events(item: dict[str, Any]) -> list[dict[str, Any]]:
    """A message item's text events: its one part added empty, the whole text as one delta, done."""
    where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    (part,) = item["content"]
    empty = {**part, "text": "", "logprobs": []}
    return [
        {"type": "response.content_part.added", **where, "part": empty},
        {"type": "response.output_text.delta", **where, "delta": part["text"], "logprobs": part["logprobs"]},
        {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": part["logprobs"]},
        {"type": "response.content_part.done", **where, "part": part},
    ]


def _call_events(item: dict[str, Any]) -> list[dict[str, Any]]:
    """A function call item's events: the whole arguments as one delta, then done."""
    where = {"item_id": item["id"], "output_index": 0}
    return [
        {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
        {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]},
    ]


def to_response_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses stream events of a finished Response object ``response`` (:func:`to_response`'s body
    with the route's ``x_`` extras), in order and numbered (module docstring). The caller sends each as an
    SSE event named by its ``type``."""
    (item,) = response["output"]
    lifecycle = _in_progress(response)
    if item["type"] == "message":
        added = {**item, "status": "in_progress", "content": []}
        body = _message_events(item)
    else:
        added = {**item, "status": "in_progress", "arguments": ""}
        body = _call_events(item)
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": lifecycle},
        {"type": "response.in_progress", "response": lifecycle},
        {"type": "response.output_item.added", "output_index": 0, "item": added},
        *body,
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": response},
    ]
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]
