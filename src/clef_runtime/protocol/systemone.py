"""Wire types of the System One API (``POST /v1/systemone``), the API of TypeSafe's Jev.

Requests are validated here (types, counts, id lengths); what needs the tokenizer (truncation, empty spans)
is checked by the encoder. Field values that the model reads (state, instructions, descriptions) are kept
exactly as the caller sent them, because the encoder renders them token-exactly as the reference does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StringConstraints,
    WithJsonSchema,
    field_validator,
)
from pydantic_core import PydanticCustomError

from clef_runtime.protocol.errors import ErrorItem
from clef_runtime.protocol.explain import ExplainOptions, explain_options
from clef_runtime.protocol.plain_errors import error_loc, plain_message, validate_object
from clef_runtime.protocol.values import Text, check_json_value, check_keys

__all__ = [
    "MAX_CHOICE_OPTIONS",
    "MAX_QUESTIONS",
    "MAX_QUESTION_ID_CHARS",
    "MAX_SCORE_LEVELS",
    "MIN_CHOICE_OPTIONS",
    "MIN_SCORE_LEVELS",
    "Answer",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "NoulAnswer",
    "NoulQuestion",
    "Question",
    "ScoreAnswer",
    "ScoreQuestion",
    "SystemOneRequest",
    "SystemOneResponse",
    "Usage",
    "independent_parts",
    "parse_request",
]

MAX_QUESTIONS = 64
MAX_QUESTION_ID_CHARS = 256
MIN_CHOICE_OPTIONS, MAX_CHOICE_OPTIONS = 2, 255
MIN_SCORE_LEVELS, MAX_SCORE_LEVELS = 2, 10

QUESTION_TYPES = ("noul", "choice", "score")

_ANY_JSON_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array", "items": {}}]
}


def _describable(value: Any) -> Any:
    # One clear error instead of pydantic's one-error-per-union-member.
    if isinstance(value, str | dict | list):
        return check_json_value(value)
    raise PydanticCustomError("describable_type", "must be a string, an object or an array")


def _optional_describable(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str | dict | list):
        return check_json_value(value)
    raise PydanticCustomError("describable_type", "must be a string, an object, an array or null")


Describable = Annotated[Any, PlainValidator(_describable), WithJsonSchema(_ANY_JSON_SCHEMA)]
"""A value the model reads: a string as is, an object or an array rendered as compact JSON."""

OptionalDescribable = Annotated[
    Any,
    PlainValidator(_optional_describable),
    WithJsonSchema({"anyOf": [*_ANY_JSON_SCHEMA["anyOf"], {"type": "null"}]}),
]

# Surrogates in ids are caught by the questions validator (check_keys), before pydantic's key check.
QuestionId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUESTION_ID_CHARS)]


class _QuestionBase(BaseModel):
    model_config = ConfigDict(extra="ignore")

    instructions: OptionalDescribable = Field(
        default=None,
        description='What to decide: a string, an object or an array. Absent, null or "" means the '
        "question id is used, as the reference encoder does.",
    )


class NoulQuestion(_QuestionBase):
    """A yes/no question (or a statement to evaluate). ``criteria`` may describe either side; a missing side
    takes the model's default text, an explicit null side is shown without a description (as the reference).
    """

    type: Literal["noul"]
    criteria: dict[Literal["true", "false"], OptionalDescribable] | None = None

    @field_validator("criteria", mode="before")
    @classmethod
    def _criteria_is_object(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise PydanticCustomError(
                "noul_criteria_type", "noul criteria must be an object with the keys 'true' and/or 'false'"
            )
        return check_keys(value)


class ChoiceQuestion(_QuestionBase):
    """One of 2-255 options. ``criteria`` maps each option id to its description (or null)."""

    type: Literal["choice"]
    criteria: Annotated[
        dict[str, OptionalDescribable],
        Field(min_length=MIN_CHOICE_OPTIONS, max_length=MAX_CHOICE_OPTIONS),
    ]

    @field_validator("criteria", mode="before")
    @classmethod
    def _criteria_is_object(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise PydanticCustomError(
                "choice_criteria_type", "choice criteria must be an object mapping option id to description"
            )
        return check_keys(value)


class ScoreQuestion(_QuestionBase):
    """One of 2-10 ordered levels; ``criteria`` lists the level descriptions, lowest first."""

    type: Literal["score"]
    criteria: Annotated[list[Describable], Field(min_length=MIN_SCORE_LEVELS, max_length=MAX_SCORE_LEVELS)]

    @field_validator("criteria", mode="before")
    @classmethod
    def _criteria_is_array(cls, value: Any) -> Any:
        if isinstance(value, dict):
            raise PydanticCustomError(
                "score_criteria_map",
                "score criteria must be an ordered array of level descriptions, lowest first "
                '(the map form {"0": ...} is not supported)',
            )
        if not isinstance(value, list):
            raise PydanticCustomError(
                "score_criteria_type", "score criteria must be an array of level descriptions"
            )
        return value


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class SystemOneRequest(BaseModel):
    """A System One decision request. Unknown top-level fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = Field(default=None, description="Any model name is accepted (e.g. jev-latest).")
    state: Annotated[Any, PlainValidator(_describable), WithJsonSchema(_ANY_JSON_SCHEMA)] = Field(
        description="The state to decide about: a string, or JSON rendered compactly with sorted keys."
    )
    questions: Annotated[dict[QuestionId, Question], Field(min_length=1, max_length=MAX_QUESTIONS)]
    x_head_digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{12,64}$")] | None = Field(
        default=None,
        description="Pin the head: answer only if the head `model` names (the model's own name: the default "
        "head) has a digest starting with these 12-64 lowercase hex digits (GET /v1/heads lists them); else "
        "409 head_changed, or 404 head_not_loaded for a name that is no served head.",
    )
    x_independent: StrictBool = Field(
        default=False,
        description="Answer each question as if it were asked alone (one request per question, sharing the "
        "state's prefill), instead of jointly (the default: the head reads all questions together).",
    )
    x_explain: Annotated[ExplainOptions | None, BeforeValidator(explain_options)] = Field(
        default=None,
        description='Evidence for every answer: true, or {"top_k": 1-20 (5), "granularity": "word" | "token" '
        '| "field"}. Each answer gains x_evidence (the state spans that most support it, with character '
        "offsets into the rendered state and, for JSON, a JSON pointer); off (and free) by default.",
    )

    @field_validator("questions", mode="before")
    @classmethod
    def _question_ids_are_text(cls, value: Any) -> Any:
        return check_keys(value)


def independent_parts(request: SystemOneRequest) -> list[SystemOneRequest]:
    """The separate requests an ``x_independent`` request is answered as: one per question, in order, each
    with the same model and state (and ``x_independent`` off). A request that is not independent, or has
    one question, is its own only part."""
    if not request.x_independent or len(request.questions) == 1:
        return [request]
    return [
        request.model_copy(update={"questions": {question_id: question}, "x_independent": False})
        for question_id, question in request.questions.items()
    ]


# ----------------------------------------------------------------------------------------------- responses


class NoulAnswer(BaseModel):
    type: Literal["noul"] = "noul"
    noul: float = Field(description="P(true), rounded to 4 decimals.")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"] = "choice"
    choice: str = Field(description="The most probable option (first maximum in the request's order).")
    confidence: float = Field(
        description="By default the probability of `choice` (Clef's definition); the server's --confidence "
        "mode may select TypeSafe's chance-corrected or Workers AI's definition."
    )
    probabilities: dict[str, float] = Field(description="Every option's probability, in the request's order.")


class ScoreAnswer(BaseModel):
    type: Literal["score"] = "score"
    score: float = Field(description="The expected level, sum(level * p).")
    confidence: float = Field(
        description="By default the largest level probability (Clef's definition); see --confidence."
    )
    legend: dict[str, Any] = Field(description="Each level key echoing the request's level description.")
    probabilities: dict[str, float]


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0


class SystemOneResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    answers: dict[str, Answer]
    usage: Usage


# ------------------------------------------------------------------------------------------------- parsing

_TAG_ERRORS = {"union_tag_invalid", "union_tag_not_found"}


def _clean_error(err: Mapping[str, Any]) -> ErrorItem:
    loc = list(error_loc(err))
    type_ = err["type"]
    # Discriminated unions insert the tag into the location: questions.<id>.choice.criteria.
    if len(loc) >= 3 and loc[0] == "questions" and loc[2] in QUESTION_TYPES:
        del loc[2]
    if type_ in _TAG_ERRORS:
        loc.append("type")
    # Dict keys are reported as <key>.[key]; name the key itself.
    key_error = bool(loc) and loc[-1] == "[key]"
    if key_error:
        loc.pop()
    msg = plain_message(err, loc)
    if type_ == "union_tag_not_found":
        msg = "field required: 'type' must be one of 'noul', 'choice', 'score'"
    elif type_ == "union_tag_invalid":
        given = err.get("input", {}).get("type")
        msg = f"unknown question type {given!r}; expected 'noul', 'choice' or 'score'"
    elif key_error and loc[:1] == ["questions"] and len(loc) == 2:
        msg = f"question id must be a string of 1 to {MAX_QUESTION_ID_CHARS} characters"
    elif key_error and loc[:1] == ["questions"] and loc[-2:-1] == ["criteria"]:
        msg = "noul criteria keys must be 'true' or 'false'"
    elif type_ == "model_attributes_type" and loc and loc[0] == "questions" and len(loc) == 2:
        msg = "a question must be an object with a 'type'"
    return {"loc": tuple(loc), "msg": msg, "type": type_}


def parse_request(data: Any) -> SystemOneRequest:
    """Validate a decoded JSON body (or an already-built request) as a System One request.

    Returns the validated request. Raises :class:`RequestValidationError` listing every problem, each with
    the location of the offending field (e.g. ``("questions", "q1", "criteria")``).
    """
    return validate_object(SystemOneRequest, data, _clean_error)
