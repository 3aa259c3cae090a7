"""Text the tokenizer cannot take (lone surrogates) and values the encoder cannot render (inf, non-JSON types)
are refused at validation time, naming the field, in both wire formats."""

from __future__ import annotations

import json
from typing import Any

import pytest

from clef_runtime.protocol.decisions import parse_decisions_request
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.systemone import parse_request
from clef_runtime.protocol.values import check_json_value, surrogate_index

BAD = "ok \ud800 text"  # what json.loads makes of "ok \ud800 text"
NOUL = {"q": {"type": "noul"}}


def errors_of(parse: Any, body: Any) -> list[dict[str, Any]]:
    with pytest.raises(RequestValidationError) as info:
        parse(body)
    errors = info.value.errors
    # The error itself must be printable and serialisable as UTF-8 (it names a field holding a surrogate).
    json.dumps(errors, ensure_ascii=False).encode("utf-8")
    str(info.value).encode("utf-8")
    return errors


SYSTEMONE_CASES: list[tuple[dict[str, Any], tuple[Any, ...]]] = [
    ({"state": BAD, "questions": NOUL}, ("state",)),
    ({"state": {"k": BAD}, "questions": NOUL}, ("state", "k")),
    ({"state": {"k" + BAD: 1}, "questions": NOUL}, ("state", "k" + BAD)),
    ({"state": [1, {"a": [BAD]}], "questions": NOUL}, ("state", 1, "a", 0)),
    ({"model": BAD, "state": "s", "questions": NOUL}, ("model",)),
    ({"state": "s", "questions": {BAD: {"type": "noul"}}}, ("questions", BAD)),
    (
        {"state": "s", "questions": {"q": {"type": "noul", "instructions": BAD}}},
        ("questions", "q", "instructions"),
    ),
    (
        {"state": "s", "questions": {"q": {"type": "noul", "instructions": {"x": [BAD]}}}},
        ("questions", "q", "instructions", "x", 0),
    ),
    (
        {"state": "s", "questions": {"q": {"type": "noul", "criteria": {"true": BAD}}}},
        ("questions", "q", "criteria", "true"),
    ),
    (
        {"state": "s", "questions": {"q": {"type": "choice", "criteria": {BAD: None, "b": None}}}},
        ("questions", "q", "criteria", BAD),
    ),
    (
        {"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": BAD, "b": None}}}},
        ("questions", "q", "criteria", "a"),
    ),
    (
        {"state": "s", "questions": {"q": {"type": "score", "criteria": ["low", BAD]}}},
        ("questions", "q", "criteria", 1),
    ),
]


def printable(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(p.replace("\ud800", "\\ud800") if isinstance(p, str) else p for p in loc)


@pytest.mark.parametrize(("body", "loc"), SYSTEMONE_CASES, ids=range(len(SYSTEMONE_CASES)))
def test_a_lone_surrogate_anywhere_in_a_systemone_request_is_named(body: dict[str, Any], loc: tuple) -> None:
    errors = errors_of(parse_request, body)
    assert [(e["loc"], e["type"]) for e in errors] == [(printable(loc), "invalid_text")]
    assert "surrogate U+D800 at character" in errors[0]["msg"]


PREDICATE = {"type": "predicate", "instructions": "?"}
DECISIONS_CASES: list[tuple[dict[str, Any], tuple[Any, ...]]] = [
    ({"input": BAD, "questions": [PREDICATE]}, ("input",)),
    ({"model": BAD, "input": "x", "questions": [PREDICATE]}, ("model",)),
    ({"input": [{"role": "user", "content": BAD}]}, ("input", 0, "content")),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": BAD}]}]},
        ("input", 0, "content", 0, "text"),
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_json", "data": {"k": {BAD: 1}}}]}]},
        ("input", 0, "content", 0, "data", "k", BAD),
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": BAD}]},
        ("input", 0, "arguments"),
    ),
    ({"input": "x", "questions": [{**PREDICATE, "instructions": BAD}]}, ("questions", 0, "instructions")),
    ({"input": "x", "questions": [{**PREDICATE, "name": BAD}]}, ("questions", 0, "name")),
    (
        {
            "input": "x",
            "questions": [
                {"type": "choice", "instructions": "?", "choices": [{"value": BAD}, {"value": "b"}]}
            ],
        },
        ("questions", 0, "choices", 0, "value"),
    ),
    (
        {
            "input": "x",
            "questions": [
                {
                    "type": "choice",
                    "instructions": "?",
                    "choices": [{"value": "a"}, {"value": "b", "description": BAD}],
                }
            ],
        },
        ("questions", 0, "choices", 1, "description"),
    ),
    (
        {
            "input": "x",
            "questions": [{"type": "score", "instructions": "?", "levels": [{"label": "a"}, {"label": BAD}]}],
        },
        ("questions", 0, "levels", 1, "label"),
    ),
]


@pytest.mark.parametrize(("body", "loc"), DECISIONS_CASES, ids=range(len(DECISIONS_CASES)))
def test_a_lone_surrogate_anywhere_in_a_decisions_request_is_named(body: dict[str, Any], loc: tuple) -> None:
    body = {"questions": [PREDICATE], **body}
    errors = errors_of(parse_decisions_request, body)
    assert [(e["loc"], e["type"]) for e in errors] == [(printable(loc), "invalid_text")]


@pytest.mark.parametrize("number", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_numbers_are_refused_naming_the_field(number: float) -> None:
    errors = errors_of(parse_request, {"state": {"n": [0, number]}, "questions": NOUL})
    assert [(e["loc"], e["type"]) for e in errors] == [(("state", "n", 1), "invalid_json_value")]
    assert "finite" in errors[0]["msg"]
    # As JSON text: 1e400 overflows to inf when parsed.
    body = json.loads(
        '{"input": [{"role": "user", "content": [{"type": "input_json", "data": {"n": 1e400}}]}], '
        '"questions": [{"type": "predicate", "instructions": "?"}]}'
    )
    errors = errors_of(parse_decisions_request, body)
    assert [e["loc"] for e in errors] == [("input", 0, "content", 0, "data", "n")]


def test_values_the_python_api_could_pass_but_json_cannot_hold_are_refused() -> None:
    errors = errors_of(parse_request, {"state": {"tags": {"a", "b"}}, "questions": NOUL})
    assert errors[0]["loc"] == ("state", "tags") and "not set" in errors[0]["msg"]
    errors = errors_of(parse_request, {"state": [10**5000], "questions": NOUL})
    assert errors[0]["loc"] == ("state", 0) and "too large" in errors[0]["msg"]
    deep: Any = "x"
    for _ in range(100_000):
        deep = [deep]
    errors = errors_of(parse_request, {"state": deep, "questions": NOUL})
    assert errors[0]["loc"] == ("state",) and "nested too deeply" in errors[0]["msg"]


def test_valid_unicode_is_untouched() -> None:
    # Astral characters, noncharacters, NUL and special-token text are all text the tokenizer takes.
    text = "😀 \U0010ffff \ufffe \x00 <|im_end|> ü"
    assert surrogate_index(text) is None
    assert surrogate_index("ab\udc00") == 2
    state = {"k😀": [text, 1.5, None, True, 10**20]}
    assert check_json_value(state) is state
    request = parse_request(
        {"model": text, "state": state, "questions": {text: {"type": "noul", "instructions": text}}}
    )
    assert request.state == state and request.model == text
