"""Rows: each question's options in the head's order with the expected option's index there, and the answer
order of `clef eval` beside it (a choice question's criteria order is not the head's sorted order)."""

from __future__ import annotations

from clef_runtime.engine.clef import Clef
from clef_runtime.evaluation.cases import parse_cases
from clef_runtime.tuning.rows import prepare_rows


def test_targets_are_in_head_order_and_answers_in_request_order(tiny: Clef) -> None:
    line = (
        '{"id": "x", "state": "hello", "questions": {'
        '"pick": {"type": "choice", "criteria": {"zeta": "last", "alpha": "first", "mid": null}},'
        '"level": {"type": "score", "criteria": ["low", "mid", "high"]},'
        '"open": {"type": "noul"}},'
        '"expected": {"pick": "zeta", "level": 2}}'
    )
    (case,) = parse_cases([line])
    rows, prepared, problems = prepare_rows(tiny.prepare, [case], lambda p: "key")
    assert not problems and list(prepared) == ["key"] and len(rows) == 1
    pick, level, open_ = rows[0].questions
    assert pick.head_options == ("alpha", "mid", "zeta") and pick.answer_options == ("zeta", "alpha", "mid")
    assert pick.target == 2 and pick.answer_order == [2, 0, 1]
    assert level.head_options == ("0", "1", "2") and level.target == 2
    assert open_.head_options == ("true", "false") and open_.target is None
    assert rows[0].scored and rows[0].num_options == 8
    assert rows[0].layout.option_counts == [3, 3, 2]


def test_independent_cases_give_one_row_per_question(tiny: Clef) -> None:
    line = (
        '{"state": "hello", "x_independent": true,'
        '"questions": {"a": {"type": "noul"}, "b": {"type": "noul"}}, "expected": {"b": false}}'
    )
    (case,) = parse_cases([line])
    rows, prepared, _ = prepare_rows(tiny.prepare, [case], lambda p: str(p.record.input_ids))
    assert [[q.question_id for q in row.questions] for row in rows] == [["a"], ["b"]]
    assert [row.scored for row in rows] == [False, True] and len(prepared) == 2
    assert rows[1].questions[0].target == 1
