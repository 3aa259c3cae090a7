"""Wire types of the OpenAI-shaped ``POST /v1/decisions`` and its mapping onto System One.

The request shape follows openai-python's ``decisions.create`` (``input``, ``questions[]`` of ``predicate`` /
``choice`` / ``score`` with an optional ``name``); the response is ``{model, answers: [...], usage}`` with the
answers as an ordered array in question order. Both are mapped onto one System One request so the same
engine answers them.

The mapping (what the model reads), field by field:

* ``input`` string -> ``state`` string. An array of input items: when every item is a user message, the
  content parts in order (``input_text`` as its text, ``input_json`` as its ``data``); one part becomes the
  state itself, several become a JSON array. Any other item (developer/system/assistant messages, tool
  calls and outputs) turns the state into an array with one object per item: ``{"role", "content"}`` for
  messages, the item's own fields (without ``id``/``status``) for tool items.
* ``questions[i].name`` -> the System One question id; unnamed questions get ``q<i+1>`` (1-based position),
  or ``q<i+1>_<k>`` if an explicit name already took that id. Duplicate names are rejected.
* ``predicate`` -> ``noul`` without criteria.
* ``choice.choices[{value, description?}]`` -> ``criteria {key: description or null}`` where ``key`` is the
  string value, or ``"true"``/``"false"`` for a boolean value. The typed value is echoed in the answer.
* ``score.levels[{label, description?}]`` -> ``criteria [level, ...]`` where a level is its label, or
  ``"<label>: <description>"`` when it has a description.
* ``instructions``: a string as is; an array of parts as one part (its text or JSON) or a JSON array.
* Images (``input_image`` parts of ``input``, inline ``data:`` URLs) go to System One's top-level ``images``
  list in order (the state is what it would be without them; Clef reads all images in one block after the
  prompt prefix). Images in ``instructions`` are refused with 422.

Answers: ``predicate {name, probability}``, ``choice {name, choice, confidence, probabilities: [{value,
probability}]}`` (choices order), ``score {name, score, confidence, probabilities: [{value, label,
probability}]}``; a question without an answer would get ``refusal {name}`` (Clef always answers).

``x_explain`` is passed on as it is; each answer then carries its ``x_evidence`` (offsets into the rendered
System One state the mapping built) and the response the engine's ``x_explain`` record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    StrictStr,
    Tag,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from clef_runtime.protocol.errors import ErrorItem, RequestValidationError
from clef_runtime.protocol.explain import EXPLAIN_DESCRIPTION, ExplainField, explain_wire
from clef_runtime.protocol.plain_errors import error_loc, plain_error, validate_object
from clef_runtime.protocol.systemone import (
    MAX_CHOICE_OPTIONS,
    MAX_QUESTION_ID_CHARS,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    MIN_CHOICE_OPTIONS,
    MIN_SCORE_LEVELS,
)
from clef_runtime.protocol.values import StrictText, Text, check_json_value, check_text, check_text_before

__all__ = [
    "DecisionChoiceAnswer",
    "DecisionPlan",
    "DecisionPredicateAnswer",
    "DecisionRefusalAnswer",
    "DecisionResponse",
    "DecisionScoreAnswer",
    "DecisionUsage",
    "DecisionsRequest",
    "PlannedQuestion",
    "choice_key",
    "generated_question_id",
    "parse_decisions_request",
    "to_decision_response",
    "to_systemone",
    "translate_error_loc",
]


# --------------------------------------------------------------------------------------------- parts


def _string_shorthand(
    one: Callable[[str], dict[str, Any]], error_type: str, message: str
) -> Callable[[Any], Any]:
    """A before-validator for a field that takes an array or, as shorthand for its one-element array
    ``[one(string)]``, a string. Normalising here keeps one code path, and no str|list union whose
    per-member errors would be confusing: anything else is the one error ``message``."""

    def validate(value: Any) -> Any:
        if isinstance(value, str):
            return [one(value)]
        if isinstance(value, list):
            return value
        raise PydanticCustomError(error_type, message)

    return validate


_text_as_parts = _string_shorthand(
    lambda text: {"type": "input_text", "text": text},
    "text_or_parts_type",
    "must be a string or an array of content parts",
)


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputTextPart(_Part):
    type: Literal["input_text"]
    text: StrictText


class OutputTextPart(_Part):
    type: Literal["output_text"]
    text: StrictText


class RefusalPart(_Part):
    type: Literal["refusal"]
    refusal: StrictText


class InputJsonPart(_Part):
    type: Literal["input_json"]
    data: dict[str, Any] | list[dict[str, Any]]

    @field_validator("data", mode="before")
    @classmethod
    def _data_is_json(cls, value: Any) -> Any:
        # One clear error instead of one per union member (an object, an array of objects).
        if not (
            isinstance(value, dict) or (isinstance(value, list) and all(isinstance(v, dict) for v in value))
        ):
            raise PydanticCustomError(
                "input_json_data_type", "data must be a JSON object or an array of objects"
            )
        return check_json_value(value)


class InputImagePart(_Part):
    """An image, as an inline ``data:`` URL (remote URLs and ``file_id`` are refused by the engine)."""

    type: Literal["input_image"]
    image_url: Text | None = None
    detail: Text | None = None
    file_id: Text | None = None


def _part_tag(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


ContentPart = Annotated[
    Annotated[InputTextPart, Tag("input_text")]
    | Annotated[OutputTextPart, Tag("output_text")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[InputJsonPart, Tag("input_json")]
    | Annotated[InputImagePart, Tag("input_image")],
    Discriminator(
        _part_tag,
        custom_error_type="content_part_type",
        custom_error_message="a content part must be an object whose 'type' is 'input_text', 'input_json', "
        "'input_image', 'output_text' or 'refusal'",
    ),
]

_TEXT_OR_PARTS_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}
TextOrParts = Annotated[
    list[ContentPart], BeforeValidator(_text_as_parts), WithJsonSchema(_TEXT_OR_PARTS_SCHEMA)
]
"""A string (one text part) or an array of content parts: message content, tool output, instructions."""


# --------------------------------------------------------------------------------------------- input


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputMessage(_Item):
    """A message of the conversation; ``type`` may be omitted."""

    type: Literal["message"] = "message"
    role: Literal["user", "developer", "system", "assistant"]
    content: TextOrParts


class _ToolCall(_Item):
    call_id: StrictText
    name: StrictText
    namespace: StrictText | None = None


class _ToolOutput(_Item):
    call_id: StrictText
    output: TextOrParts
    if TYPE_CHECKING:
        # Each subclass declares its own Literal tag (a field here would change the schema's field order).
        type: str


class FunctionCallItem(_ToolCall):
    type: Literal["function_call"]
    arguments: StrictText


class FunctionCallOutputItem(_ToolOutput):
    type: Literal["function_call_output"]


class CustomToolCallItem(_ToolCall):
    type: Literal["custom_tool_call"]
    input: StrictText


class CustomToolCallOutputItem(_ToolOutput):
    type: Literal["custom_tool_call_output"]


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
    Discriminator(
        _item_tag,
        custom_error_type="input_item_type",
        custom_error_message="an input item must be a message ({role, content}) or an object whose 'type' is "
        "'function_call', 'function_call_output', 'custom_tool_call' or 'custom_tool_call_output'",
    ),
]


# ----------------------------------------------------------------------------------------- questions

QuestionName = Annotated[
    StrictStr, Field(min_length=1, max_length=MAX_QUESTION_ID_CHARS), BeforeValidator(check_text_before)
]


class _DecisionQuestion(BaseModel):
    model_config = ConfigDict(extra="ignore")

    instructions: TextOrParts = Field(description="A string, or an array of input_text / input_json parts.")
    name: QuestionName | None = Field(
        default=None, description="Echoed in the answer; also the question id the model reads."
    )


class DecisionPredicateQuestion(_DecisionQuestion):
    """How likely a statement about the input is true (System One ``noul``)."""

    type: Literal["predicate"]


def _choice_value(value: Any) -> Any:
    # One clear error instead of one per union member (str, bool).
    if isinstance(value, str):
        return check_text(value)
    if isinstance(value, bool):
        return value
    raise PydanticCustomError("choice_value_type", "a choice value must be a string or a boolean")


ChoiceValue = Annotated[
    str | bool,
    PlainValidator(_choice_value),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "boolean"}]}),
]


class DecisionChoiceOption(BaseModel):
    model_config = ConfigDict(extra="ignore")

    value: ChoiceValue = Field(description="A string or a boolean; echoed typed in the answer.")
    description: StrictText | None = None


class DecisionChoiceQuestion(_DecisionQuestion):
    """One of 2-255 unique choices (System One ``choice``)."""

    type: Literal["choice"]
    choices: Annotated[
        list[DecisionChoiceOption], Field(min_length=MIN_CHOICE_OPTIONS, max_length=MAX_CHOICE_OPTIONS)
    ]


class DecisionScoreLevel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    label: StrictText
    description: StrictText | None = None


class DecisionScoreQuestion(_DecisionQuestion):
    """One of 2-10 ordered levels, lowest first (System One ``score``)."""

    type: Literal["score"]
    levels: Annotated[
        list[DecisionScoreLevel], Field(min_length=MIN_SCORE_LEVELS, max_length=MAX_SCORE_LEVELS)
    ]


DecisionQuestion = Annotated[
    Annotated[DecisionPredicateQuestion, Tag("predicate")]
    | Annotated[DecisionChoiceQuestion, Tag("choice")]
    | Annotated[DecisionScoreQuestion, Tag("score")],
    Discriminator(
        _part_tag,
        custom_error_type="question_type",
        custom_error_message="a question must be an object whose 'type' is 'predicate', 'choice' or 'score'",
    ),
]


_items_of_input = _string_shorthand(
    lambda text: {"role": "user", "content": text},
    "input_type",
    "input must be a string or an array of input items",
)


class DecisionsRequest(BaseModel):
    """An OpenAI-shaped decisions request. Unknown top-level fields (``prompt_cache_key``,
    ``safety_identifier``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: StrictText | None = Field(default=None, description="Any model name is accepted.")
    input: Annotated[
        list[InputItem],
        Field(min_length=1),
        BeforeValidator(_items_of_input),
        WithJsonSchema(
            {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object"}}]}
        ),
    ] = Field(description="A string, or an ordered array of messages and tool items.")
    questions: Annotated[list[DecisionQuestion], Field(min_length=1, max_length=MAX_QUESTIONS)]
    x_explain: ExplainField = Field(default=None, description=EXPLAIN_DESCRIPTION)


# ----------------------------------------------------------------------------------------- responses


class DecisionPredicateAnswer(BaseModel):
    type: Literal["predicate"] = "predicate"
    name: str | None
    probability: float


class DecisionChoiceProbability(BaseModel):
    value: str | bool
    probability: float


class DecisionChoiceAnswer(BaseModel):
    type: Literal["choice"] = "choice"
    name: str | None
    choice: str | bool
    confidence: float
    probabilities: list[DecisionChoiceProbability]


class DecisionScoreProbability(BaseModel):
    value: int
    label: str
    probability: float


class DecisionScoreAnswer(BaseModel):
    type: Literal["score"] = "score"
    name: str | None
    score: float
    confidence: float
    probabilities: list[DecisionScoreProbability]


class DecisionRefusalAnswer(BaseModel):
    type: Literal["refusal"] = "refusal"
    name: str | None


class _InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class _OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class DecisionUsage(BaseModel):
    input_tokens: int
    input_tokens_details: _InputTokensDetails
    output_tokens: int
    output_tokens_details: _OutputTokensDetails
    total_tokens: int


class DecisionResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    answers: list[
        Annotated[
            DecisionPredicateAnswer | DecisionChoiceAnswer | DecisionScoreAnswer | DecisionRefusalAnswer,
            Field(discriminator="type"),
        ]
    ]
    usage: DecisionUsage


# ------------------------------------------------------------------------------------------- parsing


def _strip_union_tags(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """Drop the union-member labels pydantic inserts into locations (``questions.0.choice.choices``):
    walking the request data, a segment that is not a key/index of the value at that point is a label."""
    out: list[Any] = []
    node = data
    tag_dropped = False  # at most one discriminator tag per object
    for seg in loc:
        if isinstance(node, str):
            # Deeper segments were made up by the string shorthand (``"input": "..."`` stands for a message
            # with one text part): the string is the field the caller sent.
            break
        if (
            isinstance(node, dict)
            and not tag_dropped
            and seg not in node
            and seg == node.get("type", "message")
        ):
            tag_dropped = True
            continue
        tag_dropped = False
        descends = (isinstance(node, dict) and seg in node) or (
            isinstance(node, list) and isinstance(seg, int) and 0 <= seg < len(node)
        )
        if descends:
            out.append(seg)
            node = node[seg]
        elif isinstance(node, dict | list) and isinstance(seg, str) and seg != "[key]":
            # A label (the node did not descend). Missing fields, though, are real keys that are absent:
            # keep a segment that names a field the models know.
            if seg in _FIELD_NAMES:
                out.append(seg)
                node = None
        else:
            out.append(seg)
            node = None
    return tuple(out)


_FIELD_NAMES = frozenset(
    {
        "model",
        "input",
        "questions",
        "type",
        "instructions",
        "name",
        "choices",
        "value",
        "description",
        "levels",
        "label",
        "role",
        "content",
        "text",
        "data",
        "image_url",
        "refusal",
        "call_id",
        "arguments",
        "output",
        "namespace",
    }
)


def parse_decisions_request(data: Any) -> DecisionsRequest:
    """Validate a decoded JSON body as a decisions request.

    Returns the validated request. Raises :class:`RequestValidationError` listing every problem, each with
    its location in the decisions body (e.g. ``("questions", 0, "choices")``).
    """
    return validate_object(
        DecisionsRequest, data, lambda err: plain_error(err, _strip_union_tags(error_loc(err), data))
    )


# ------------------------------------------------------------------------------------------- mapping


@dataclass(frozen=True)
class PlannedQuestion:
    """How one decisions question maps onto System One, kept to build its answer."""

    index: int
    question_id: str
    name: str | None
    kind: Literal["predicate", "choice", "score"]
    choice_values: tuple[tuple[str, str | bool], ...] = ()
    """(System One option key, original typed value), in the request's choices order."""
    level_labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class DecisionPlan:
    """The mapping of a whole request: one :class:`PlannedQuestion` per question, in order."""

    questions: tuple[PlannedQuestion, ...]

    def index_of(self, question_id: str) -> int | None:
        """The position of the question with System One id ``question_id``, or None."""
        for planned in self.questions:
            if planned.question_id == question_id:
                return planned.index
        return None


def choice_key(value: str | bool) -> str:
    """The System One option id of a typed choice value: the string itself, ``"true"``/``"false"``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def generated_question_id(index: int, taken: set[str]) -> str:
    """The id of an unnamed question at 0-based ``index``: ``q<index+1>``, or ``q<index+1>_<k>`` (k = 2, 3,
    ...) when an explicit name already uses it."""
    base = f"q{index + 1}"
    if base not in taken:
        return base
    k = 2
    while f"{base}_{k}" in taken:
        k += 1
    return f"{base}_{k}"


def _pieces(parts: list[Any], loc: tuple[Any, ...], images: list[dict[str, Any]] | None) -> list[Any]:
    """The text / JSON values of ``parts`` in order; image parts go to ``images`` (refused when None)."""
    pieces: list[Any] = []
    for j, part in enumerate(parts):
        if isinstance(part, InputTextPart | OutputTextPart):
            pieces.append(part.text)
        elif isinstance(part, RefusalPart):
            pieces.append(part.refusal)
        elif isinstance(part, InputJsonPart):
            pieces.append(part.data)
        elif images is None:
            raise RequestValidationError.single(
                (*loc, j), "images are read from `input` only, not from instructions", "image_not_supported"
            )
        else:
            images.append(part.model_dump(exclude_none=True))
    return pieces


def _one_or_many(pieces: list[Any]) -> Any:
    if not pieces:
        return ""
    return pieces[0] if len(pieces) == 1 else pieces


def _state_of(items: list[Any], images: list[dict[str, Any]]) -> Any:
    if all(isinstance(item, InputMessage) and item.role == "user" for item in items):
        pieces: list[Any] = []
        for i, item in enumerate(items):
            pieces.extend(_pieces(item.content, ("input", i, "content"), images))
        if not pieces and not images:
            raise RequestValidationError.single(
                ("input",), "the input has no text, JSON or image", "too_short"
            )
        return _one_or_many(pieces)
    rendered: list[Any] = []
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            content = _one_or_many(_pieces(item.content, ("input", i, "content"), images))
            rendered.append({"role": item.role, "content": content})
        elif isinstance(item, _ToolOutput):
            output = _one_or_many(_pieces(item.output, ("input", i, "output"), images))
            rendered.append({"type": item.type, "call_id": item.call_id, "output": output})
        else:
            rendered.append(item.model_dump(exclude_none=True))
    return rendered


def to_systemone(request: DecisionsRequest) -> tuple[dict[str, Any], DecisionPlan]:
    """Map a validated decisions request onto a System One request body (a dict for the engine's parser).

    Returns ``(systemone_body, plan)``. Raises :class:`RequestValidationError` for what System One cannot
    express: duplicate names or choices, images.
    """
    errors: list[ErrorItem] = []
    names: dict[str, int] = {}
    for i, question in enumerate(request.questions):
        if question.name is not None:
            if question.name in names:
                errors.append(
                    {
                        "loc": ("questions", i, "name"),
                        "msg": f"duplicate question name {question.name!r} "
                        f"(also question {names[question.name]})",
                        "type": "duplicate_name",
                    }
                )
            else:
                names[question.name] = i
    if errors:
        raise RequestValidationError(errors)

    taken = set(names)
    planned: list[PlannedQuestion] = []
    questions: dict[str, Any] = {}
    for i, question in enumerate(request.questions):
        if question.name is not None:
            qid = question.name
        else:
            qid = generated_question_id(i, taken)
            taken.add(qid)
        instruction_pieces = _pieces(question.instructions, ("questions", i, "instructions"), None)
        if not instruction_pieces:
            errors.append(
                {
                    "loc": ("questions", i, "instructions"),
                    "msg": "at least one text or JSON part is required",
                    "type": "too_short",
                }
            )
            continue
        instructions = _one_or_many(instruction_pieces)
        if isinstance(question, DecisionPredicateQuestion):
            questions[qid] = {"type": "noul", "instructions": instructions}
            planned.append(PlannedQuestion(i, qid, question.name, "predicate"))
        elif isinstance(question, DecisionChoiceQuestion):
            criteria: dict[str, Any] = {}
            values: list[tuple[str, str | bool]] = []
            for j, option in enumerate(question.choices):
                key = choice_key(option.value)
                if key in criteria:
                    errors.append(
                        {
                            "loc": ("questions", i, "choices", j, "value"),
                            "msg": f"each choice must be unique; {option.value!r} repeats option id {key!r}",
                            "type": "duplicate_choice",
                        }
                    )
                    continue
                criteria[key] = option.description
                values.append((key, option.value))
            questions[qid] = {"type": "choice", "instructions": instructions, "criteria": criteria}
            planned.append(PlannedQuestion(i, qid, question.name, "choice", choice_values=tuple(values)))
        else:
            levels = [
                level.label if not level.description else f"{level.label}: {level.description}"
                for level in question.levels
            ]
            questions[qid] = {"type": "score", "instructions": instructions, "criteria": levels}
            labels = tuple(level.label for level in question.levels)
            planned.append(PlannedQuestion(i, qid, question.name, "score", level_labels=labels))
    if errors:
        raise RequestValidationError(errors)
    images: list[dict[str, Any]] = []
    body: dict[str, Any] = {"state": _state_of(request.input, images), "questions": questions}
    if images:
        # Cloudflare's top-level list (it takes input_image parts as they are): the state stays exactly what
        # it would be without the images, and the encoder puts every image in one block after the prefix.
        body["images"] = images
    if request.model is not None:
        body["model"] = request.model
    explain = explain_wire(request.x_explain)
    if explain is not None:
        body["x_explain"] = explain
    return body, DecisionPlan(tuple(planned))


def translate_error_loc(loc: tuple[Any, ...], plan: DecisionPlan) -> tuple[Any, ...]:
    """Translate the location of an error found in the mapped System One request back to the decisions
    body: ``("questions", "<id>", "criteria", ...)`` -> ``("questions", <index>, "choices"|"levels", ...)``,
    ``("state", ...)`` -> ``("input",)``. Unknown shapes are returned unchanged."""
    if not loc:
        return loc
    if loc[0] in ("state", "images"):
        return ("input",)
    if loc[0] == "questions" and len(loc) >= 2:
        index = plan.index_of(str(loc[1]))
        if index is None:
            return ("questions",)
        rest = list(loc[2:])
        if rest and rest[0] == "criteria":
            kind = plan.questions[index].kind
            rest[0] = "choices" if kind == "choice" else "levels" if kind == "score" else "instructions"
            if kind == "choice" and len(rest) > 1:
                keys = [key for key, _ in plan.questions[index].choice_values]
                rest = [rest[0], keys.index(rest[1])] if rest[1] in keys else [rest[0]]
        return ("questions", index, *rest)
    return loc


def _answer_of(planned: PlannedQuestion, answer: dict[str, Any]) -> dict[str, Any]:
    """One question's decisions answer from its System One answer (its ``x_evidence`` kept when present)."""
    out: dict[str, Any]
    if planned.kind == "predicate":
        out = {"type": "predicate", "name": planned.name, "probability": answer["noul"]}
    elif planned.kind == "choice":
        by_key = dict(planned.choice_values)
        probabilities = answer["probabilities"]
        out = {
            "type": "choice",
            "name": planned.name,
            "choice": by_key[answer["choice"]],
            "confidence": answer["confidence"],
            "probabilities": [
                {"value": value, "probability": probabilities[key]} for key, value in planned.choice_values
            ],
        }
    else:
        probabilities = answer["probabilities"]
        out = {
            "type": "score",
            "name": planned.name,
            "score": answer["score"],
            "confidence": answer["confidence"],
            "probabilities": [
                {"value": i, "label": label, "probability": probabilities[str(i)]}
                for i, label in enumerate(planned.level_labels)
            ],
        }
    if "x_evidence" in answer:
        out["x_evidence"] = answer["x_evidence"]
    return out


def to_decision_response(systemone: dict[str, Any], plan: DecisionPlan) -> dict[str, Any]:
    """Build the decisions response body from the engine's System One response and the mapping plan.

    Returns ``{"model", "answers": [...], "usage": {...}}`` with answers in question order. A question the
    engine did not answer gets a ``refusal``. Raises ``KeyError``/``ValueError`` only if the engine's
    response is malformed (a server bug, not a client error).
    """
    answers_in = systemone.get("answers", {})
    answers: list[dict[str, Any]] = []
    for planned in plan.questions:
        answer = answers_in.get(planned.question_id)
        if answer is None:
            answers.append({"type": "refusal", "name": planned.name})
            continue
        answers.append(_answer_of(planned, answer))
    usage_in = systemone.get("usage", {})
    input_tokens = int(usage_in.get("input_tokens", 0))
    output_tokens = int(usage_in.get("output_tokens", 0))
    cached_tokens = int(usage_in.get("input_tokens_details", {}).get("cached_tokens", 0))
    out: dict[str, Any] = {
        "model": systemone.get("model", ""),
        "answers": answers,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }
    for extra in ("x_state_cache", "x_explain"):  # the engine's reports travel with the answer
        if extra in systemone:
            out[extra] = systemone[extra]
    return out
