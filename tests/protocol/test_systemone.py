"""Validation rules of the System One request model, positive and negative."""

from __future__ import annotations

from typing import Any

import pytest

from clef_runtime.protocol.errors import RequestValidationError, format_loc
from clef_runtime.protocol.systemone import (
    ChoiceQuestion,
    NoulQuestion,
    ScoreQuestion,
    SystemOneRequest,
    parse_request,
)


def req(questions: Any, **top: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"state": "s", "questions": questions}
    body.update(top)
    return body


def errors_of(body: Any) -> list[dict[str, Any]]:
    with pytest.raises(RequestValidationError) as info:
        parse_request(body)
    return info.value.errors


def locs_of(body: Any) -> list[tuple[Any, ...]]:
    return [e["loc"] for e in errors_of(body)]


# ----------------------------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("model", [None, "jev-latest", "clef-flash", "anything at all", ""])
def test_any_model_string_is_accepted(model: str | None) -> None:
    body = req({"q": {"type": "noul"}})
    if model is not None:
        body["model"] = model
    assert parse_request(body).model == model


@pytest.mark.parametrize("state", ["text", "", {"a": 1, "b": [1.0, None]}, [1, "two", {"x": True}], {}])
def test_state_string_object_array(state: Any) -> None:
    assert parse_request(req({"q": {"type": "noul"}}, state=state)).state == state


def test_unknown_top_level_and_question_fields_are_ignored() -> None:
    body = req({"q": {"type": "noul", "weight": 3}}, extra={"x": 1}, stream=True)
    parsed = parse_request(body)
    assert not hasattr(parsed, "extra")
    assert isinstance(parsed.questions["q"], NoulQuestion)


def test_question_order_and_unicode_ids_are_kept() -> None:
    ids = ["zeta", "Alpha", "é", "日本語", "🙂 emoji id", "x" * 256]
    parsed = parse_request(req({i: {"type": "noul"} for i in ids}))
    assert list(parsed.questions) == ids


@pytest.mark.parametrize("instructions", [None, "", "Is it?", {"ask": "x"}, ["a", 1], {}, []])
def test_instruction_forms(instructions: Any) -> None:
    parsed = parse_request(req({"q": {"type": "noul", "instructions": instructions}}))
    assert parsed.questions["q"].instructions == instructions


@pytest.mark.parametrize(
    "criteria",
    [None, {}, {"true": "yes"}, {"false": {"k": 1}}, {"true": ["a"], "false": None}, {"true": None}],
)
def test_noul_criteria_forms(criteria: Any) -> None:
    question = parse_request(req({"q": {"type": "noul", "criteria": criteria}})).questions["q"]
    assert isinstance(question, NoulQuestion)
    assert question.criteria == criteria


def test_choice_criteria_keep_request_order_and_null_descriptions() -> None:
    criteria = {"b": "bee", "a": None, "C": {"x": 1}, "1": ["list"]}
    question = parse_request(req({"q": {"type": "choice", "criteria": criteria}})).questions["q"]
    assert isinstance(question, ChoiceQuestion)
    assert list(question.criteria) == ["b", "a", "C", "1"]
    assert question.criteria == criteria


def test_score_levels_of_every_describable_kind() -> None:
    criteria = ["low", {"level": "mid"}, ["high", 3]]
    question = parse_request(req({"q": {"type": "score", "criteria": criteria}})).questions["q"]
    assert isinstance(question, ScoreQuestion)
    assert question.criteria == criteria


# ----------------------------------------------------------------------------------------------- counts


@pytest.mark.parametrize(("n", "ok"), [(0, False), (1, True), (63, True), (64, True), (65, False)])
def test_question_count_bounds(n: int, ok: bool) -> None:
    body = req({f"q{i}": {"type": "noul"} for i in range(n)})
    if ok:
        assert len(parse_request(body).questions) == n
    else:
        assert locs_of(body) == [("questions",)]


@pytest.mark.parametrize(("n", "ok"), [(1, False), (2, True), (254, True), (255, True), (256, False)])
def test_choice_option_count_bounds(n: int, ok: bool) -> None:
    body = req({"q": {"type": "choice", "criteria": {f"o{i}": None for i in range(n)}}})
    if ok:
        assert len(parse_request(body).questions["q"].criteria) == n  # type: ignore[union-attr]
    else:
        assert locs_of(body) == [("questions", "q", "criteria")]


@pytest.mark.parametrize(("n", "ok"), [(1, False), (2, True), (9, True), (10, True), (11, False)])
def test_score_level_count_bounds(n: int, ok: bool) -> None:
    body = req({"q": {"type": "score", "criteria": [f"l{i}" for i in range(n)]}})
    if ok:
        assert len(parse_request(body).questions["q"].criteria) == n  # type: ignore[union-attr]
    else:
        assert locs_of(body) == [("questions", "q", "criteria")]


@pytest.mark.parametrize(("length", "ok"), [(0, False), (1, True), (255, True), (256, True), (257, False)])
def test_question_id_length_bounds(length: int, ok: bool) -> None:
    qid = "é" * length
    body = req({qid: {"type": "noul"}})
    if ok:
        assert list(parse_request(body).questions) == [qid]
    else:
        errs = errors_of(body)
        assert [e["loc"] for e in errs] == [("questions", qid)]
        assert "question id" in errs[0]["msg"]


# ----------------------------------------------------------------------------------------------- rejected


@pytest.mark.parametrize(
    ("body", "loc", "needle"),
    [
        (req({"q": {"type": "boolean"}}), ("questions", "q", "type"), "unknown question type"),
        (req({"q": {}}), ("questions", "q", "type"), "type"),
        (req({"q": {"type": 1}}), ("questions", "q", "type"), "type"),
        (req({"q": "noul"}), ("questions", "q"), "object"),
        (req({"q": {"type": "noul", "criteria": "yes"}}), ("questions", "q", "criteria"), "noul criteria"),
        (
            req({"q": {"type": "noul", "criteria": ["a", "b"]}}),
            ("questions", "q", "criteria"),
            "noul criteria",
        ),
        (
            req({"q": {"type": "noul", "criteria": {"maybe": "x"}}}),
            ("questions", "q", "criteria", "maybe"),
            "true",
        ),
        (
            req({"q": {"type": "noul", "criteria": {"true": 1}}}),
            ("questions", "q", "criteria", "true"),
            "string",
        ),
        (req({"q": {"type": "choice", "criteria": ["a", "b"]}}), ("questions", "q", "criteria"), "object"),
        (req({"q": {"type": "choice"}}), ("questions", "q", "criteria"), "required"),
        (req({"q": {"type": "choice", "criteria": None}}), ("questions", "q", "criteria"), "object"),
        (
            req({"q": {"type": "choice", "criteria": {"a": 1, "b": 2}}}),
            ("questions", "q", "criteria", "a"),
            "string",
        ),
        (
            req({"q": {"type": "score", "criteria": {"0": "a", "1": "b"}}}),
            ("questions", "q", "criteria"),
            "map form",
        ),
        (req({"q": {"type": "score", "criteria": "low,high"}}), ("questions", "q", "criteria"), "array"),
        (req({"q": {"type": "score", "criteria": ["a", None]}}), ("questions", "q", "criteria", 1), "string"),
        (req({"q": {"type": "score"}}), ("questions", "q", "criteria"), "required"),
        (req({"q": {"type": "noul", "instructions": 5}}), ("questions", "q", "instructions"), "string"),
        (req({"q": {"type": "noul", "instructions": True}}), ("questions", "q", "instructions"), "string"),
        (req({"q": {"type": "noul"}}, model=7), ("model",), "string"),
        (req({"q": {"type": "noul"}}, state=5), ("state",), "string"),
        (req({"q": {"type": "noul"}}, state=None), ("state",), "string"),
        (req({"q": {"type": "noul"}}, state=True), ("state",), "string"),
        ({"questions": {"q": {"type": "noul"}}}, ("state",), "required"),
        ({"state": "s"}, ("questions",), "required"),
        (req([{"type": "noul"}]), ("questions",), "questions must be an object, got an array"),
    ],
)
def test_rejections_name_the_field(body: dict[str, Any], loc: tuple[Any, ...], needle: str) -> None:
    errs = errors_of(body)
    assert loc in [e["loc"] for e in errs], errs
    msg = next(e["msg"] for e in errs if e["loc"] == loc)
    assert needle.lower() in msg.lower()
    assert all(set(e) == {"loc", "msg", "type"} for e in errs)


@pytest.mark.parametrize("body", [[], "text", 3, None])
def test_body_must_be_an_object(body: Any) -> None:
    assert locs_of(body) == [()]


def test_all_problems_are_reported_at_once() -> None:
    body = {"state": 3, "questions": {"a": {"type": "x"}, "b": {"type": "score", "criteria": ["one"]}}}
    locs = locs_of(body)
    assert ("state",) in locs
    assert ("questions", "a", "type") in locs
    assert ("questions", "b", "criteria") in locs


def test_error_message_names_the_first_field() -> None:
    with pytest.raises(RequestValidationError) as info:
        parse_request(req({"q": {"type": "choice", "criteria": ["a"]}}))
    assert str(info.value).startswith("questions.q.criteria: ")
    assert format_loc(("questions", "q", "criteria", 3)) == "questions.q.criteria[3]"


def test_parse_is_idempotent_on_a_parsed_request() -> None:
    parsed = parse_request(req({"q": {"type": "noul"}}))
    assert parse_request(parsed) is parsed
    assert isinstance(parsed, SystemOneRequest)


def test_openapi_schema_is_generated() -> None:
    schema = SystemOneRequest.model_json_schema()
    assert schema["required"] == ["state", "questions"]
    assert schema["properties"]["questions"]["maxProperties"] == 64
