"""pydantic's validation errors in plain words: each message names the field and says what it must be.

pydantic writes "List should have at least 2 items after validation, not 1", "Input should be a valid
dictionary or instance of DecisionChoiceOption" or "Value error, ...": phrases about its own machinery. A
caller of the API reads "criteria must have at least 2 entries, got 1" instead. The error ``type`` stays
pydantic's (clients match on it); only ``msg`` is rewritten, for the common kinds listed in `_PHRASES`.
Errors raised by this package's own validators (``PydanticCustomError``) already speak plainly and are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from clef_runtime.protocol.errors import ErrorItem, RequestValidationError

__all__ = ["error_loc", "plain_error", "plain_message", "validate_object"]

ModelT = TypeVar("ModelT", bound=BaseModel)

_SHOWN_INPUT_CHARS = 40


def error_loc(err: Mapping[str, Any]) -> tuple[str | int, ...]:
    """The error's location, extended by the path inside the value that this package's validators put in
    the error's context (a key or item of a JSON value, say)."""
    return (*err["loc"], *(err.get("ctx") or {}).get("path", ()))


def _field(loc: Sequence[str | int]) -> str:
    """How a message names the field: its last name with any indexes after it (``choices[1]``)."""
    tail = ""
    for part in reversed(loc):
        if not isinstance(part, int):
            return str(part) + tail
        tail = f"[{part}]" + tail
    return "item" + tail if tail else "the request body"


def _kind(value: Any) -> str:
    """A JSON value's kind, as a sentence names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_INPUT_CHARS else text[: _SHOWN_INPUT_CHARS - 3] + "..."


def _entries(count: Any) -> str:
    return f"{count} entry" if count == 1 else f"{count} entries"


def _size(err: Mapping[str, Any]) -> str:
    # pydantic stops counting a dict past its limit (actual_length None): count the input instead.
    actual = (err.get("ctx") or {}).get("actual_length")
    if actual is None and isinstance(err.get("input"), dict | list | tuple | str):
        actual = len(err["input"])
    return "more" if actual is None else str(actual)


_TEXT_SOURCES = ("query", "header", "path", "cookie")
"""Where every value arrives as a string (FastAPI's first location part): its kind says nothing."""


def _must_be(what: str) -> Callable[[str, Mapping[str, Any]], str]:
    def phrase(field: str, err: Mapping[str, Any]) -> str:
        value = err.get("input")
        loc = err.get("loc") or ("",)
        got = _shown(value) if loc[0] in _TEXT_SOURCES else _kind(value)
        return f"{field} must be {what}, got {got}"

    return phrase


def _bound(relation: str, key: str) -> Callable[[str, Mapping[str, Any]], str]:
    # A number as it was written (a query parameter arrives as the string "0").
    return lambda field, err: (
        f"{field} must be {relation} {err['ctx'][key]}, got {str(err.get('input'))[:40]}"
    )


def _after_prefix(prefix: str) -> Callable[[str, Mapping[str, Any]], str]:
    return lambda field, err: str(err["msg"]).removeprefix(prefix)


_PHRASES: dict[str, Callable[[str, Mapping[str, Any]], str]] = {
    "missing": lambda field, err: f"{field} is required",
    "extra_forbidden": lambda field, err: f"unknown field {field!r}",
    "too_short": lambda field, err: (
        f"{field} must have at least {_entries(err['ctx']['min_length'])}, got {_size(err)}"
    ),
    "too_long": lambda field, err: (
        f"{field} must have at most {_entries(err['ctx']['max_length'])}, got {_size(err)}"
    ),
    "string_too_short": lambda field, err: (
        f"{field} must be at least {err['ctx']['min_length']} character(s) long"
    ),
    "string_too_long": lambda field, err: (
        f"{field} must be at most {err['ctx']['max_length']} characters long, got {_size(err)}"
    ),
    "literal_error": lambda field, err: (
        f"{field} must be {err['ctx']['expected']}, got {_shown(err.get('input'))}"
    ),
    "enum": lambda field, err: f"{field} must be {err['ctx']['expected']}, got {_shown(err.get('input'))}",
    "string_type": _must_be("a string"),
    "int_type": _must_be("an integer"),
    "int_parsing": _must_be("an integer"),
    "int_from_float": _must_be("a whole number"),
    "float_type": _must_be("a number"),
    "float_parsing": _must_be("a number"),
    "bool_type": _must_be("true or false"),
    "bool_parsing": _must_be("true or false"),
    "dict_type": _must_be("an object"),
    "model_type": _must_be("an object"),
    "model_attributes_type": _must_be("an object"),
    "list_type": _must_be("an array"),
    "greater_than": _bound("greater than", "gt"),
    "greater_than_equal": _bound("at least", "ge"),
    "less_than": _bound("less than", "lt"),
    "less_than_equal": _bound("at most", "le"),
    "value_error": _after_prefix("Value error, "),
    "assertion_error": _after_prefix("Assertion failed, "),
}


def plain_message(err: Mapping[str, Any], loc: Sequence[str | int] | None = None) -> str:
    """The message of the pydantic error ``err`` in plain words, naming the field at ``loc`` (default: the
    error's own location). Kinds without a phrase keep pydantic's message."""
    phrase = _PHRASES.get(str(err.get("type")))
    if phrase is None:
        return str(err["msg"])
    try:
        return phrase(_field(error_loc(err) if loc is None else loc), err)
    except (KeyError, TypeError):  # a context without the expected key: pydantic's words are still true
        return str(err["msg"])


def plain_error(err: Mapping[str, Any], loc: Sequence[str | int] | None = None) -> ErrorItem:
    """``{"loc", "msg", "type"}`` of the pydantic error ``err``: its location (``loc``, default
    `error_loc`) and its message in plain words."""
    where = tuple(error_loc(err) if loc is None else loc)
    return {"loc": where, "msg": plain_message(err, where), "type": err["type"]}


def validate_object(
    model: type[ModelT], data: Any, error_item: Callable[[Any], ErrorItem] = plain_error
) -> ModelT:
    """Validate a decoded JSON body as ``model`` (a request that must be a JSON object; an already built
    ``model`` is returned as it is).

    ``error_item``: one pydantic error as the error the client reads (default: `plain_error`; a protocol
    whose locations need cleaning passes its own). Returns the validated model. Raises
    :class:`RequestValidationError` naming each bad field in plain words.
    """
    if isinstance(data, model):
        return data
    if not isinstance(data, dict):
        raise RequestValidationError.single((), "the request body must be a JSON object", "model_type")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(error_item(e) for e in exc.errors(include_url=False)) from None
