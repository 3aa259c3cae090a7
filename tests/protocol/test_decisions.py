"""The OpenAI-shaped /v1/decisions wire types and their mapping onto System One."""

from __future__ import annotations

from typing import Any

import pytest

from clef_runtime.protocol.decisions import (
    DecisionResponse,
    choice_key,
    generated_question_id,
    parse_decisions_request,
    to_decision_response,
    to_systemone,
    translate_error_loc,
)
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.systemone import parse_request


def mapped(body: dict[str, Any]) -> dict[str, Any]:
    systemone, _ = to_systemone(parse_decisions_request(body))
    parse_request(systemone)  # the mapping must always produce a valid System One request
    return systemone


def errors_of(body: Any) -> list[dict[str, Any]]:
    with pytest.raises(RequestValidationError) as info:
        to_systemone(parse_decisions_request(body))
    return info.value.errors


PREDICATE = {"type": "predicate", "instructions": "Is it urgent?"}


def test_string_input_becomes_the_state_and_questions_get_positional_ids() -> None:
    body = {
        "model": "gpt-6-luna",
        "input": "Charged twice.",
        "questions": [PREDICATE, {**PREDICATE, "name": "refund"}, PREDICATE],
    }
    assert mapped(body) == {
        "model": "gpt-6-luna",
        "state": "Charged twice.",
        "questions": {
            "q1": {"type": "noul", "instructions": "Is it urgent?"},
            "refund": {"type": "noul", "instructions": "Is it urgent?"},
            "q3": {"type": "noul", "instructions": "Is it urgent?"},
        },
    }


def test_generated_id_steps_around_an_explicit_name() -> None:
    body = {"input": "x", "questions": [PREDICATE, {**PREDICATE, "name": "q1"}]}
    assert list(mapped(body)["questions"]) == ["q1_2", "q1"]
    assert generated_question_id(0, {"q1", "q1_2"}) == "q1_3"
    assert generated_question_id(4, set()) == "q5"


def test_choice_values_keep_their_type_and_map_to_string_keys() -> None:
    body = {
        "input": "x",
        "questions": [
            {
                "type": "choice",
                "instructions": "Refund?",
                "choices": [{"value": True, "description": "yes"}, {"value": False}, {"value": "maybe"}],
            }
        ],
    }
    assert mapped(body)["questions"]["q1"]["criteria"] == {"true": "yes", "false": None, "maybe": None}
    assert (choice_key(True), choice_key(False), choice_key("True")) == ("true", "false", "True")


def test_score_levels_fold_descriptions_into_the_level_text() -> None:
    body = {
        "input": "x",
        "questions": [
            {
                "type": "score",
                "instructions": "Urgency?",
                "levels": [{"label": "low"}, {"label": "high", "description": "today"}],
            }
        ],
    }
    assert mapped(body)["questions"]["q1"]["criteria"] == ["low", "high: today"]


def test_instruction_parts_become_text_or_a_json_array() -> None:
    one = {"input": "x", "questions": [{**PREDICATE, "instructions": [{"type": "input_text", "text": "a"}]}]}
    assert mapped(one)["questions"]["q1"]["instructions"] == "a"
    two_parts = [{"type": "input_text", "text": "a"}, {"type": "input_json", "data": {"k": [1, 2]}}]
    two = {"input": "x", "questions": [{**PREDICATE, "instructions": two_parts}]}
    assert mapped(two)["questions"]["q1"]["instructions"] == ["a", {"k": [1, 2]}]


def test_user_messages_concatenate_their_parts() -> None:
    body = {
        "input": [
            {"role": "user", "content": "first"},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_json", "data": {"id": 7}},
                    {"type": "input_text", "text": "last"},
                ],
            },
        ],
        "questions": [PREDICATE],
    }
    assert mapped(body)["state"] == ["first", {"id": 7}, "last"]
    single = {
        "input": [{"role": "user", "content": [{"type": "input_json", "data": {"id": 7}}]}],
        "questions": [PREDICATE],
    }
    assert mapped(single)["state"] == {"id": 7}


def test_conversations_with_other_roles_and_tools_become_an_array_of_objects() -> None:
    body = {
        "input": [
            {"role": "system", "content": "Be strict."},
            {"role": "user", "content": "Refund me."},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "lookup",
                "arguments": "{}",
                "id": "x",
                "status": None,
            },
            {"type": "function_call_output", "call_id": "c1", "output": "paid twice"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        ],
        "questions": [PREDICATE],
    }
    assert mapped(body)["state"] == [
        {"role": "system", "content": "Be strict."},
        {"role": "user", "content": "Refund me."},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "paid twice"},
        {"role": "assistant", "content": "Checking."},
    ]


def test_unknown_fields_are_ignored() -> None:
    body = {"input": "x", "questions": [PREDICATE], "prompt_cache_key": "k", "safety_identifier": "u1"}
    assert "prompt_cache_key" not in mapped(body)


@pytest.mark.parametrize(
    ("body", "loc", "error_type"),
    [
        ({"questions": [PREDICATE]}, ("input",), "missing"),
        ({"input": 5, "questions": [PREDICATE]}, ("input",), "input_type"),
        ({"input": [], "questions": [PREDICATE]}, ("input",), "too_short"),
        ({"input": "x", "questions": []}, ("questions",), "too_short"),
        ({"input": "x", "questions": [PREDICATE] * 65}, ("questions",), "too_long"),
        (
            {"input": "x", "questions": [{"type": "boolean", "instructions": "?"}]},
            ("questions", 0),
            "question_type",
        ),
        ({"input": "x", "questions": [{"type": "predicate"}]}, ("questions", 0, "instructions"), "missing"),
        (
            {"input": "x", "questions": [{**PREDICATE, "name": ""}]},
            ("questions", 0, "name"),
            "string_too_short",
        ),
        ({"input": "x", "questions": [{**PREDICATE, "name": 3}]}, ("questions", 0, "name"), "string_type"),
        (
            {
                "input": "x",
                "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}]}],
            },
            ("questions", 0, "choices"),
            "too_short",
        ),
        (
            {
                "input": "x",
                "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": 1}] * 2}],
            },
            ("questions", 0, "choices", 0, "value"),
            "choice_value_type",
        ),
        (
            {
                "input": "x",
                "questions": [{"type": "score", "instructions": "?", "levels": [{"label": "a"}] * 11}],
            },
            ("questions", 0, "levels"),
            "too_long",
        ),
        (
            {"input": [{"role": "robot", "content": "hi"}], "questions": [PREDICATE]},
            ("input", 0, "role"),
            "literal_error",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}], "questions": [PREDICATE]},
            ("input", 0, "content", 0, "text"),
            "missing",
        ),
        (
            {
                "input": "x",
                "questions": [{**PREDICATE, "instructions": [{"type": "input_image", "image_url": "d"}]}],
            },
            ("questions", 0, "instructions", 0),
            "image_not_supported",
        ),
        (
            {"input": "x", "questions": [{**PREDICATE, "instructions": []}]},
            ("questions", 0, "instructions"),
            "too_short",
        ),
        (
            {"input": "x", "questions": [PREDICATE, {**PREDICATE, "name": "a"}, {**PREDICATE, "name": "a"}]},
            ("questions", 2, "name"),
            "duplicate_name",
        ),
        (
            {
                "input": "x",
                "questions": [
                    {"type": "choice", "instructions": "?", "choices": [{"value": True}, {"value": "true"}]}
                ],
            },
            ("questions", 0, "choices", 1, "value"),
            "duplicate_choice",
        ),
        ([1, 2], (), "model_type"),
    ],
)
def test_invalid_requests_name_the_offending_field(body: Any, loc: tuple[Any, ...], error_type: str) -> None:
    errors = errors_of(body)
    assert {"loc": loc, "type": error_type} in [{"loc": e["loc"], "type": e["type"]} for e in errors], errors


def test_unicode_names_and_values_round_trip() -> None:
    body = {
        "input": "배송이 안 와요",
        "questions": [
            {
                "type": "choice",
                "name": "종류 🎯",
                "instructions": "?",
                "choices": [{"value": "환불"}, {"value": "🙂 기타"}],
            }
        ],
    }
    systemone = mapped(body)
    assert systemone["questions"]["종류 🎯"]["criteria"] == {"환불": None, "🙂 기타": None}


def _plan_and_answer() -> tuple[Any, dict[str, Any]]:
    body = {
        "input": "x",
        "questions": [
            {"type": "predicate", "instructions": "p?"},
            {
                "type": "choice",
                "name": "c",
                "instructions": "?",
                "choices": [{"value": False}, {"value": "b"}],
            },
            {
                "type": "score",
                "name": "s",
                "instructions": "?",
                "levels": [{"label": "lo"}, {"label": "hi", "description": "d"}],
            },
        ],
    }
    _, plan = to_systemone(parse_decisions_request(body))
    answer = {
        "model": "clef-flash",
        "answers": {
            # deliberately in another order than the questions: the mapping goes by id
            "s": {
                "type": "score",
                "score": 0.75,
                "confidence": 0.75,
                "legend": {"0": "lo", "1": "hi: d"},
                "probabilities": {"0": 0.25, "1": 0.75},
            },
            "c": {
                "type": "choice",
                "choice": "false",
                "confidence": 0.6,
                "probabilities": {"false": 0.6, "b": 0.4},
            },
            "q1": {"type": "noul", "noul": 0.125},
        },
        "usage": {"input_tokens": 321, "output_tokens": 0},
    }
    return plan, answer


def test_answers_come_back_in_question_order_with_typed_values() -> None:
    plan, answer = _plan_and_answer()
    response = to_decision_response(answer, plan)
    assert response == {
        "model": "clef-flash",
        "answers": [
            {"type": "predicate", "name": None, "probability": 0.125},
            {
                "type": "choice",
                "name": "c",
                "choice": False,
                "confidence": 0.6,
                "probabilities": [{"value": False, "probability": 0.6}, {"value": "b", "probability": 0.4}],
            },
            {
                "type": "score",
                "name": "s",
                "score": 0.75,
                "confidence": 0.75,
                "probabilities": [
                    {"value": 0, "label": "lo", "probability": 0.25},
                    {"value": 1, "label": "hi", "probability": 0.75},
                ],
            },
        ],
        "usage": {
            "input_tokens": 321,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 321,
        },
    }
    DecisionResponse.model_validate(response)  # the documented response model accepts it


def test_a_missing_answer_becomes_a_refusal() -> None:
    plan, answer = _plan_and_answer()
    del answer["answers"]["c"]
    assert to_decision_response(answer, plan)["answers"][1] == {"type": "refusal", "name": "c"}


def test_error_locations_translate_back_to_the_decisions_body() -> None:
    plan, _ = _plan_and_answer()
    assert translate_error_loc(("questions", "c", "criteria", "b"), plan) == ("questions", 1, "choices", 1)
    assert translate_error_loc(("questions", "s", "criteria", 1), plan) == ("questions", 2, "levels", 1)
    assert translate_error_loc(("questions", "q1", "instructions"), plan) == ("questions", 0, "instructions")
    assert translate_error_loc(("state",), plan) == ("input",)
    assert translate_error_loc(("questions", "nope"), plan) == ("questions",)
    assert translate_error_loc(("model",), plan) == ("model",)


PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def test_input_images_go_to_the_top_level_images_list_and_leave_the_state_alone() -> None:
    image = {"type": "input_image", "image_url": PNG_URL, "detail": "low"}
    body = {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is shown?"}, image]}],
        "questions": [PREDICATE],
    }
    systemone = mapped(body)
    assert systemone["state"] == "What is shown?"
    assert systemone["images"] == [image]
    only_image = {"input": [{"role": "user", "content": [image]}], "questions": [PREDICATE]}
    assert (mapped(only_image)["state"], mapped(only_image)["images"]) == ("", [image])
    tool = {
        "input": [
            {"role": "system", "content": "Judge the screenshot."},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_text", "text": "ok"}, image],
            },
        ],
        "questions": [PREDICATE],
    }
    systemone = mapped(tool)
    assert systemone["state"][1] == {"type": "function_call_output", "call_id": "c", "output": "ok"}
    assert systemone["images"] == [image]
    assert "images" not in mapped({"input": "text only", "questions": [PREDICATE]})


def test_an_empty_input_is_refused() -> None:
    errors = errors_of({"input": [{"role": "user", "content": []}], "questions": [PREDICATE]})
    assert errors[0]["loc"] == ("input",)


def test_image_errors_found_by_the_engine_point_at_input() -> None:
    plan, _ = _plan_and_answer()
    assert translate_error_loc(("images", 0), plan) == ("input",)


def test_the_state_cache_report_travels_to_the_decisions_response() -> None:
    plan, answer = _plan_and_answer()
    answer = {
        **answer,
        "usage": {"input_tokens": 321, "output_tokens": 0, "input_tokens_details": {"cached_tokens": 250}},
        "x_state_cache": "partial",
    }
    response = to_decision_response(answer, plan)
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 250, "cache_write_tokens": 0}
    assert response["x_state_cache"] == "partial"
    DecisionResponse.model_validate(response)
