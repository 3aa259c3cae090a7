"""Case files: one JSON object per line (UTF-8), a System One request plus the expected answers.

``{"id": "t-17", "state": ..., "questions": {...}, "images": [...], "expected": {question_id: answer}}``
with an answer ``true``/``false`` for noul, the option id for choice and the 0-based integer level for score.
``id`` is optional (default ``line-N``); questions without an expected answer are answered but not scored.
Blank lines are skipped; every invalid line is reported with its number, none is skipped silently.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_runtime.protocol.errors import RequestValidationError, format_loc
from clef_runtime.protocol.images import parse_with_images
from clef_runtime.protocol.systemone import ChoiceQuestion, NoulQuestion, SystemOneRequest

__all__ = [
    "Case",
    "CaseFileError",
    "CaseFileUnusable",
    "answer_options",
    "expected_index",
    "load_cases",
    "parse_cases",
]

#: Case keys that are not part of the System One request.
CASE_KEYS = ("id", "expected")


class CaseFileError(ValueError):
    """A case file has invalid lines. ``problems``: ``(line number, message)`` for every one of them."""

    def __init__(self, source: str, problems: list[tuple[int, str]]) -> None:
        self.source = source
        self.problems = problems
        first = "; ".join(f"line {n}: {msg}" for n, msg in problems[:3])
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        super().__init__(f"{source}: {len(problems)} invalid line(s): {first}{more}")

    def lines(self) -> list[str]:
        """One ``SOURCE:N: message`` line per problem (what the CLI prints)."""
        return [f"{self.source}:{n}: {msg}" for n, msg in self.problems]


class CaseFileUnusable(CaseFileError):
    """The file as a whole cannot be used (unreadable, not UTF-8, no case at all): no line is to blame, so
    the CLI prints ``message`` alone rather than a count of invalid lines."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(source, [(0, message)])
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Case:
    """One valid case: the request to send (``body``: the line without ``id`` and ``expected``), its parsed
    form (images taken out) and the expected answers."""

    line: int
    id: str
    body: dict[str, Any]
    request: SystemOneRequest
    expected: Mapping[str, bool | str | int] = field(default_factory=dict)

    def question_type(self, question_id: str) -> str:
        """``noul``, ``choice`` or ``score``."""
        return str(self.request.questions[question_id].type)


def answer_options(question: Any) -> tuple[str, ...]:
    """A question's option ids in answer order: ``true, false`` (noul); the request's criteria order
    (choice: the order the served ``choice`` breaks ties in); ``"0".."n-1"`` (score)."""
    if isinstance(question, NoulQuestion):
        return ("true", "false")
    if isinstance(question, ChoiceQuestion):
        return tuple(str(key) for key in question.criteria)
    return tuple(str(i) for i in range(len(question.criteria)))


def expected_index(question: Any, answer: bool | str | int) -> int:
    """The index in `answer_options` of an expected answer (validated by `parse_cases`)."""
    if isinstance(question, NoulQuestion):
        return 0 if answer is True else 1
    if isinstance(question, ChoiceQuestion):
        return answer_options(question).index(str(answer))
    return int(answer)


def _expected_problem(question: Any, answer: Any) -> str | None:
    if isinstance(question, NoulQuestion):
        return None if isinstance(answer, bool) else f"must be true or false, got {json.dumps(answer)}"
    if isinstance(question, ChoiceQuestion):
        options = answer_options(question)
        if isinstance(answer, str) and answer in options:
            return None
        return f"must be one of the options {', '.join(options)}, got {json.dumps(answer)}"
    levels = len(question.criteria)
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < levels:
        return None
    return f"must be an integer level 0..{levels - 1}, got {json.dumps(answer)}"


def _parse_line(number: int, text: str, seen: set[str]) -> tuple[Case | None, list[str]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [f"malformed JSON: {exc.msg} (column {exc.colno})"]
    if not isinstance(data, dict):
        return None, [f"a case must be a JSON object, got {type(data).__name__}"]
    problems: list[str] = []
    case_id = data.get("id", f"line-{number}")
    if not isinstance(case_id, str | int) or isinstance(case_id, bool) or str(case_id) == "":
        problems.append(f"id must be a non-empty string or an integer, got {json.dumps(case_id)}")
        case_id = f"line-{number}"
    case_id = str(case_id)
    if case_id in seen:
        problems.append(f"id {case_id!r} is used by an earlier case")
    body = {key: value for key, value in data.items() if key not in CASE_KEYS}
    try:
        request, _images = parse_with_images(body)
    except RequestValidationError as exc:
        problems.extend(f"{format_loc(e['loc'])}: {e['msg']}" for e in exc.errors)
        return None, problems
    expected = data.get("expected", {})
    if not isinstance(expected, dict):
        problems.append(f"expected must be an object {{question_id: answer}}, got {json.dumps(expected)}")
        expected = {}
    for question_id, answer in expected.items():
        question = request.questions.get(question_id)
        if question is None:
            problems.append(f"expected.{question_id}: no such question in this case")
            continue
        problem = _expected_problem(question, answer)
        if problem:
            problems.append(f"expected.{question_id} ({question.type}): {problem}")
    if problems:
        return None, problems
    seen.add(case_id)
    return Case(line=number, id=case_id, body=body, request=request, expected=dict(expected)), []


def parse_cases(lines: Iterable[str], source: str = "<cases>") -> list[Case]:
    """Every case of ``lines`` (one JSON object per line; blank lines skipped).

    Returns the cases in file order. Raises `CaseFileError` listing every invalid line (with its number and
    each problem, the field named), or when there is no case at all.
    """
    cases: list[Case] = []
    problems: list[tuple[int, str]] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        case, errors = _parse_line(number, line, seen)
        if case is not None:
            cases.append(case)
        problems.extend((number, error) for error in errors)
    if problems:
        raise CaseFileError(source, problems)
    if not cases:
        raise CaseFileUnusable(source, f"{source} has no cases (the file is empty)")
    return cases


def load_cases(path: str | Path) -> list[Case]:
    """`parse_cases` of a file. Raises `CaseFileError` for invalid lines, `CaseFileUnusable` (a
    `CaseFileError`) for a file that cannot be read, is not UTF-8 or holds no case."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CaseFileUnusable(str(path), f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CaseFileUnusable(
            str(path), f"cannot read {path}: it is not UTF-8 text ({exc.reason})"
        ) from None
    return parse_cases(text.splitlines(), str(path))
