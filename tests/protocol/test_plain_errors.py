"""Validation messages in plain words: each names the field and the limit, none reads as pydantic's internals
("List should have at least 2 items after validation", "Input should be a valid dictionary or instance of X",
"Value error, ...")."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pytest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from clef_runtime.protocol.decisions import parse_decisions_request
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.openai_chat import parse_chat_request
from clef_runtime.protocol.plain_errors import plain_error
from clef_runtime.protocol.systemone import parse_request


class Inner(BaseModel):
    label: StrictStr


class Sample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    options: Annotated[list[str], Field(min_length=2, max_length=3)] = ["a", "b"]
    table: Annotated[dict[str, int], Field(max_length=2)] = {}
    name: StrictStr = "n"
    short: Annotated[str, Field(max_length=4)] = ""
    count: StrictInt = 0
    ratio: float = 0.0
    flag: StrictBool = False
    role: Literal["user", "system"] = "user"
    inner: Inner | None = None
    limit: Annotated[int, Field(ge=1, le=9)] = 1
    needed: int
    even: int = 0

    @field_validator("even")
    @classmethod
    def _even(cls, value: int) -> int:
        if value % 2:
            raise ValueError(f"even must be an even number, got {value}")
        return value


def message_for(**fields: Any) -> tuple[str, str]:
    """(type, plain message) of the one error ``Sample(needed=1, **fields)`` raises."""
    with pytest.raises(ValidationError) as raised:
        Sample.model_validate({"needed": 1, **fields})
    (error,) = raised.value.errors()
    item = plain_error(error)
    return item["type"], item["msg"]


@pytest.mark.parametrize(
    ("fields", "kind", "message"),
    [
        ({"options": ["a"]}, "too_short", "options must have at least 2 entries, got 1"),
        ({"options": ["a", "b", "c", "d"]}, "too_long", "options must have at most 3 entries, got 4"),
        ({"table": {"a": 1, "b": 2, "c": 3}}, "too_long", "table must have at most 2 entries, got 3"),
        ({"short": "abcdef"}, "string_too_long", "short must be at most 4 characters long, got 6"),
        ({"bogus": 1}, "extra_forbidden", "unknown field 'bogus'"),
        ({"role": "bot"}, "literal_error", "role must be 'user' or 'system', got 'bot'"),
        ({"name": 5}, "string_type", "name must be a string, got a number"),
        ({"count": "3"}, "int_type", "count must be an integer, got a string"),
        ({"ratio": "fast"}, "float_parsing", "ratio must be a number, got a string"),
        ({"flag": "yes"}, "bool_type", "flag must be true or false, got a string"),
        ({"table": [1]}, "dict_type", "table must be an object, got an array"),
        ({"inner": "x"}, "model_type", "inner must be an object, got a string"),
        ({"inner": {"label": None}}, "string_type", "label must be a string, got null"),
        ({"limit": 0}, "greater_than_equal", "limit must be at least 1, got 0"),
        ({"limit": 10}, "less_than_equal", "limit must be at most 9, got 10"),
        ({"even": 3}, "value_error", "even must be an even number, got 3"),
    ],
)
def test_each_kind_names_the_field_and_the_limit(fields: dict[str, Any], kind: str, message: str) -> None:
    assert message_for(**fields) == (kind, message)


def test_a_missing_field_is_required() -> None:
    with pytest.raises(ValidationError) as raised:
        Sample.model_validate({})
    (error,) = raised.value.errors()
    assert plain_error(error) == {"loc": ("needed",), "msg": "needed is required", "type": "missing"}


def test_list_items_are_named_with_their_index() -> None:
    with pytest.raises(ValidationError) as raised:
        Sample.model_validate({"needed": 1, "options": ["a", 2]})
    (error,) = raised.value.errors()
    assert plain_error(error)["msg"] == "options[1] must be a string, got a number"


class Limits(BaseModel):
    limit: int = 1


class Request(BaseModel):
    """Shaped like FastAPI's request parameters: the first location part says where a value came from."""

    query: Limits = Limits()
    body: Limits = Limits()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        # Every query value is a string: its kind says nothing, the value itself does.
        ({"query": {"limit": "abc"}}, "limit must be an integer, got 'abc'"),
        ({"body": {"limit": "abc"}}, "limit must be an integer, got a string"),
    ],
)
def test_a_query_value_is_shown_a_body_value_named_by_kind(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        Request.model_validate(data)
    (error,) = raised.value.errors()
    assert plain_error(error)["msg"] == message


_PYDANTIC_PHRASES = (
    "should",
    "after validation",
    "valid dictionary",
    "instance of",
    "Value error",
    "Field required",
)


@pytest.mark.parametrize(
    ("parse", "body", "message"),
    [
        (
            parse_request,
            {"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": None}}}},
            "criteria must have at least 2 entries, got 1",
        ),
        (
            parse_request,
            {"state": "s", "questions": {"q": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
            "criteria must have at most 10 entries, got 11",
        ),
        (
            parse_request,
            {"state": "s", "questions": {f"q{i}": {"type": "noul"} for i in range(65)}},
            "questions must have at most 64 entries, got 65",
        ),
        (parse_request, {"questions": {"q": {"type": "noul"}}}, "state is required"),
        (
            parse_request,
            {"state": "s", "model": 5, "questions": {"q": {"type": "noul"}}},
            "model must be a string",
        ),
        (
            parse_decisions_request,
            {
                "input": "x",
                "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}]}],
            },
            "choices must have at least 2 entries, got 1",
        ),
        (
            parse_decisions_request,
            {"input": "x", "questions": [{"type": "choice", "instructions": "?", "choices": ["a", "b"]}]},
            "choices[0] must be an object, got a string",
        ),
        (
            parse_decisions_request,
            {
                "input": [{"role": "bot", "content": "x"}],
                "questions": [{"type": "predicate", "instructions": "?"}],
            },
            "role must be 'user', 'developer', 'system' or 'assistant', got 'bot'",
        ),
        (
            parse_decisions_request,
            {
                "input": "x",
                "questions": [{"type": "predicate", "instructions": [{"type": "input_json", "data": 5}]}],
            },
            "data must be a JSON object or an array of objects",
        ),
        (parse_chat_request, {"messages": []}, "messages must have at least 1 entry, got 0"),
        (
            parse_chat_request,
            {"messages": [{"role": "user", "content": "x"}], "response_format": "json"},
            "response_format must be an object, got a string",
        ),
        (
            parse_chat_request,
            {"messages": [{"role": "user", "content": "x"}], "n": "2"},
            "n must be an integer",
        ),
    ],
)
def test_every_route_speaks_plainly(parse: Any, body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestValidationError) as raised:
        parse(body)
    messages = [error["msg"] for error in raised.value.errors]
    assert any(message in text for text in messages), messages
    for text in messages:
        assert not any(phrase in text for phrase in _PYDANTIC_PHRASES), text
