"""What a request may carry: text the tokenizer can take and JSON values the encoder can render.

The tokenizer takes any text that can be encoded as UTF-8, which is every Python string except one holding a
surrogate code point (U+D800..U+DFFF: a lone UTF-16 surrogate such as JSON's ``"\\ud800"``, or a pair kept as
two code points by the Python API). Special-token text is not an error: it is read as the special token, as
the reference encoder does. The encoder renders a non-string value as compact JSON, so a value must be made
of JSON types only (str keys, finite numbers: ``1e400`` parses to ``inf`` and JSON has no ``Infinity``).

These checks run in the pydantic validators of the wire types, so the server's routes, the CLI and the Python
API refuse such input with a 422-style :class:`~clef_runtime.protocol.errors.RequestValidationError` before
any model work. A problem inside a nested value carries its path in the error context (``ctx["path"]``); the
parse functions append it to the field's location.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import AfterValidator, StrictStr
from pydantic_core import PydanticCustomError

__all__ = [
    "INVALID_TEXT",
    "INVALID_VALUE",
    "StrictText",
    "Text",
    "check_json_value",
    "check_keys",
    "check_text",
    "check_text_before",
    "surrogate_index",
]

INVALID_TEXT = "invalid_text"
"""Error type of a string the tokenizer cannot take."""
INVALID_VALUE = "invalid_json_value"
"""Error type of a value that is not finite JSON (inf/nan, a non-JSON Python type, a non-string key)."""

_CHECK = json.JSONEncoder(ensure_ascii=False, allow_nan=False, check_circular=False)


# Python refuses to turn an int of more than sys.get_int_max_str_digits() digits (4300 by default) into text;
# below this many bits an int has fewer digits than that, so the check is skipped.
_MAX_INT_BITS = 14_000


def _renders(number: int) -> bool:
    try:
        str(number)
    except ValueError:
        return False
    return True


def surrogate_index(text: str) -> int | None:
    """Index of the first surrogate code point of ``text`` (not encodable as UTF-8), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _text_error(text: str, index: int, what: str, path: tuple[Any, ...]) -> PydanticCustomError:
    return PydanticCustomError(
        INVALID_TEXT,
        "{what} has a lone UTF-16 surrogate U+{code} at character {index}; text must be valid Unicode "
        "(encodable as UTF-8)",
        {"what": what, "code": f"{ord(text[index]):04X}", "index": index, "path": path},
    )


def check_text(value: str) -> str:
    """Return ``value`` if the tokenizer can take it. Raises ``PydanticCustomError`` (type
    :data:`INVALID_TEXT`) naming the first surrogate's position otherwise."""
    index = surrogate_index(value)
    if index is not None:
        raise _text_error(value, index, "the text", ())
    return value


def _path(link: tuple[Any, ...] | None) -> tuple[Any, ...]:
    # Paths are kept as (parent link, key) chains while walking, so a deep value costs linear time.
    parts: list[Any] = []
    while link is not None:
        link, key = link
        parts.append(key)
    return tuple(reversed(parts))


def _first_problem(value: Any) -> PydanticCustomError | None:
    """Walk ``value`` (iteratively: a Python caller may nest deeper than the recursion limit) and describe
    its first problem, with the path to it in ``ctx["path"]``."""
    stack: list[tuple[tuple[Any, ...] | None, Any]] = [(None, value)]
    while stack:
        link, node = stack.pop()
        if isinstance(node, str):
            index = surrogate_index(node)
            if index is not None:
                return _text_error(node, index, "the text", _path(link))
        elif isinstance(node, bool) or node is None:
            continue
        elif isinstance(node, int):
            if node.bit_length() > _MAX_INT_BITS and not _renders(node):
                return PydanticCustomError(
                    INVALID_VALUE, "the integer is too large to render as text", {"path": _path(link)}
                )
        elif isinstance(node, float):
            if not math.isfinite(node):
                return PydanticCustomError(
                    INVALID_VALUE,
                    "numbers must be finite, got {number} (JSON has no Infinity or NaN, and a number as "
                    "large as 1e400 overflows to inf)",
                    {"number": repr(node), "path": _path(link)},
                )
        elif isinstance(node, dict):
            items = list(node.items())
            for key, _ in items:
                if not isinstance(key, str):
                    return PydanticCustomError(
                        INVALID_VALUE,
                        "object keys must be strings (got {kind})",
                        {"kind": type(key).__name__, "path": _path(link)},
                    )
                index = surrogate_index(key)
                if index is not None:
                    return _text_error(key, index, "the object key", _path((link, key)))
            stack.extend(((link, key), child) for key, child in reversed(items))
        elif isinstance(node, list):
            stack.extend(((link, i), child) for i, child in reversed(list(enumerate(node))))
        else:
            return PydanticCustomError(
                INVALID_VALUE,
                "must be a JSON value (string, number, boolean, null, object or array), not {kind}",
                {"kind": type(node).__name__, "path": _path(link)},
            )
    return None


def check_json_value(value: Any) -> Any:
    """Return ``value`` if it is a JSON value the encoder can render and the tokenizer take: JSON types only,
    string keys, finite numbers, no surrogates. Raises ``PydanticCustomError`` (type :data:`INVALID_TEXT` or
    :data:`INVALID_VALUE`) with the path to the first problem in ``ctx["path"]``."""
    if isinstance(value, str):
        return check_text(value)
    try:
        # The common case at C speed: rendering fails on every problem the walk below would name.
        _CHECK.encode(value).encode("utf-8")
        return value
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError):
        pass
    problem = _first_problem(value)
    if problem is not None:
        raise problem
    # The walk found nothing, so the renderer ran out of stack.
    raise PydanticCustomError(INVALID_VALUE, "the value is nested too deeply", {"path": ()})


def check_keys(value: Any) -> Any:
    """Return ``value``; when it is a dict, first check its keys (pydantic's own dict-key check would reject
    a surrogate with a message about string parsing and the key mangled). Raises ``PydanticCustomError``
    with ``ctx["path"] == (key,)``. For use as a ``mode="before"`` validator."""
    if isinstance(value, dict):
        for key in value:
            if isinstance(key, str):
                index = surrogate_index(key)
                if index is not None:
                    raise _text_error(key, index, "the key", (key,))
    return value


def check_text_before(value: Any) -> Any:
    """:func:`check_text` for a value not yet validated as a string (a ``mode="before"`` validator: pydantic's
    length-constrained strings reject a surrogate themselves, with a message about parsing)."""
    return check_text(value) if isinstance(value, str) else value


Text = Annotated[str, AfterValidator(check_text)]
"""A string the tokenizer can take."""
StrictText = Annotated[StrictStr, AfterValidator(check_text)]
"""A strict string (no coercion) the tokenizer can take."""
