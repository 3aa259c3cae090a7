"""Cases as the head sees them: one `TuneRow` per model row (a case, or each question of an ``x_independent``
case), with each question's options in the head's order and the expected option's index there.

The head scores options in the encoder's order (noul ``true, false``; choice option ids sorted; score levels
``0..n-1``), while answers and metrics use `answer_options` (choice: the request's criteria order); a
`QuestionTarget` holds both orders, so logits become `Outcome` probabilities without another lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clef_runtime.engine.independent import IndependentRequest
from clef_runtime.engine.preparer import PreparedRequest
from clef_runtime.evaluation.cases import Case, answer_options, expected_index
from clef_runtime.model.head import HeadLayout
from clef_runtime.protocol.errors import ClefError, RequestValidationError, format_loc

__all__ = ["QuestionTarget", "RowProblem", "TuneRow", "prepare_rows"]


@dataclass(frozen=True)
class QuestionTarget:
    """One question of a row: its id and type, its options in head order and in answer order, and the head
    index of the expected option (None: the case does not say; the question is not scored)."""

    question_id: str
    question_type: str
    head_options: tuple[str, ...]
    answer_options: tuple[str, ...]
    target: int | None

    @property
    def answer_order(self) -> list[int]:
        """For each answer-order option, its index in head order."""
        return [self.head_options.index(option) for option in self.answer_options]


@dataclass(frozen=True)
class TuneRow:
    """One model row of a case: ``key`` names its backbone features (see `clef_runtime.tuning.features`),
    ``layout`` is where the head reads it, ``questions`` its questions in head order."""

    case_index: int
    case_id: str
    key: str
    layout: HeadLayout
    questions: tuple[QuestionTarget, ...]

    @property
    def scored(self) -> bool:
        """Whether any question of the row has an expected answer."""
        return any(question.target is not None for question in self.questions)

    @property
    def num_options(self) -> int:
        """Options over the row's questions."""
        return self.layout.num_options


@dataclass(frozen=True)
class RowProblem:
    """A case the engine refuses to prepare (too long, a bad image): its line, id and why."""

    line: int
    case_id: str
    message: str


def _message(error: ClefError) -> str:
    if isinstance(error, RequestValidationError):
        return "; ".join(f"{format_loc(e['loc'])}: {e['msg']}" for e in error.errors)
    return error.message


def _row(case_index: int, case: Case, prepared: PreparedRequest, key: str) -> TuneRow:
    record = prepared.record
    questions = []
    for encoded in record.questions:
        question = case.request.questions[encoded.question_id]
        answers = answer_options(question)
        expected = case.expected.get(encoded.question_id)
        target = None
        if expected is not None:
            target = encoded.option_ids.index(answers[expected_index(question, expected)])
        questions.append(
            QuestionTarget(
                question_id=encoded.question_id,
                question_type=str(question.type),
                head_options=tuple(encoded.option_ids),
                answer_options=answers,
                target=target,
            )
        )
    layout = HeadLayout(
        type_ids=[q.type_id for q in record.questions],
        question_spans=[q.question_span for q in record.questions],
        option_spans=[list(q.option_spans) for q in record.questions],
    )
    return TuneRow(case_index, case.id, key, layout, tuple(questions))


def prepare_rows(
    prepare: Callable[[dict[str, Any]], Any], cases: Sequence[Case], key_of: Callable[[PreparedRequest], str]
) -> tuple[list[TuneRow], dict[str, PreparedRequest], list[RowProblem]]:
    """Prepares every case (``prepare``: `Clef.prepare`) and names each row's features (``key_of``: a
    `PreparedRequest` -> key). Returns the rows in case order, the prepared request of each key (what the
    backbone needs for a missing feature) and the cases that could not be prepared."""
    rows: list[TuneRow] = []
    prepared_by_key: dict[str, PreparedRequest] = {}
    problems: list[RowProblem] = []
    for case_index, case in enumerate(cases):
        try:
            prepared = prepare(case.body)
        except ClefError as error:
            problems.append(RowProblem(case.line, case.id, _message(error)))
            continue
        parts = prepared.parts if isinstance(prepared, IndependentRequest) else (prepared,)
        for part in parts:
            key = key_of(part)
            prepared_by_key.setdefault(key, part)
            rows.append(_row(case_index, case, part, key))
    return rows, prepared_by_key, problems
