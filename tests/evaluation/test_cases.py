"""Case files: valid lines parse to cases with expected indexes; every invalid line is reported with its
number (the CLI lists them all and exits 2 before loading any model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_runtime.cli import main
from clef_runtime.evaluation.cases import CaseFileError, answer_options, expected_index, parse_cases

QUESTIONS = {
    "spam": {"type": "noul"},
    "team": {"type": "choice", "criteria": {"tech": None, "billing": "charges", "sales": None}},
    "urgency": {"type": "score", "criteria": ["low", "mid", "high"]},
}


def line(**fields: object) -> str:
    return json.dumps({"state": "a ticket", "questions": QUESTIONS, **fields})


def test_valid_cases_keep_their_body_ids_and_expected_indexes() -> None:
    cases = parse_cases(
        [
            line(id="a", expected={"spam": False, "team": "billing", "urgency": 2}),
            "",
            line(expected={"team": "sales"}),
            line(id=7),
        ]
    )
    assert [c.id for c in cases] == ["a", "line-3", "7"]
    assert [c.line for c in cases] == [1, 3, 4]
    first = cases[0]
    assert "expected" not in first.body and "id" not in first.body
    assert first.body["questions"] == QUESTIONS
    questions = first.request.questions
    assert answer_options(questions["team"]) == ("tech", "billing", "sales")  # criteria order, not sorted
    assert answer_options(questions["spam"]) == ("true", "false")
    assert answer_options(questions["urgency"]) == ("0", "1", "2")
    assert expected_index(questions["spam"], False) == 1
    assert expected_index(questions["team"], "billing") == 1
    assert expected_index(questions["urgency"], 2) == 2
    assert cases[2].expected == {}


BAD_LINES = [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"state": "x"}), "questions"),
    (line(expected={"nope": True}), "expected.nope: no such question"),
    (line(expected={"spam": "yes"}), "expected.spam (noul): must be true or false"),
    (
        line(expected={"team": "legal"}),
        "expected.team (choice): must be one of the options tech, billing, sales",
    ),
    (line(expected={"urgency": 3}), "expected.urgency (score): must be an integer level 0..2"),
    (line(expected={"urgency": True}), "expected.urgency (score)"),
    (line(expected=["spam"]), "expected must be an object"),
    (line(id=""), "id must be a non-empty string"),
]


@pytest.mark.parametrize(("text", "needle"), BAD_LINES)
def test_each_invalid_line_is_named(text: str, needle: str) -> None:
    with pytest.raises(CaseFileError) as caught:
        parse_cases([line(id="ok"), text], "cases.jsonl")
    assert len(caught.value.problems) >= 1
    assert all(number == 2 for number, _ in caught.value.problems)
    assert any(needle in message for _, message in caught.value.problems), caught.value.problems


def test_duplicate_ids_and_an_empty_file() -> None:
    with pytest.raises(CaseFileError, match="line 2: id 'x' is used by an earlier case"):
        parse_cases([line(id="x"), line(id="x")])
    with pytest.raises(CaseFileError, match="no cases"):
        parse_cases(["", "  "])


def test_cli_lists_every_invalid_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cases.jsonl"
    lines = [line(id="ok"), BAD_LINES[0][0], line(id="ok2"), BAD_LINES[5][0], "", BAD_LINES[6][0]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for command in (
        ["eval", str(path), "--model", "tiny"],
        ["calibrate", str(path), "--out", str(tmp_path / "c.json")],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"{path}:2: malformed JSON" in err
        assert f"{path}:4: expected.team (choice)" in err
        assert f"{path}:6: expected.urgency (score)" in err
        assert "3 invalid line(s)" in err
        assert "Traceback" not in err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "{missing}"],
        ["calibrate", "{missing}", "--out", "{out}"],
        ["calibrate", "{good}", "--holdout", "{missing}", "--out", "{out}"],
        ["compare", "{missing}", "--a", "model=tiny", "--b", "model=tiny"],
    ],
)
def test_cli_missing_case_file_is_one_line_and_exit_2(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, good = tmp_path / "missing.jsonl", tmp_path / "good.jsonl"
    good.write_text(line(id="ok") + "\n", encoding="utf-8")
    paths = {"missing": missing, "good": good, "out": tmp_path / "c.json"}
    assert main([part.format(**paths) for part in command]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"clef {command[0]}: error: cannot read {missing}: No such file or directory"
    ]
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"\xff\xfe{}\n", "cannot read {path}: it is not UTF-8 text"), (b"\n  \n", "{path} has no cases")],
)
def test_cli_unusable_case_file_is_one_line_and_exit_2(
    content: bytes, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cases.jsonl"
    path.write_bytes(content)
    assert main(["eval", str(path)]) == 2
    (err,) = capsys.readouterr().err.splitlines()
    assert err.startswith(f"clef eval: error: {message.format(path=path)}"), err


def test_example_case_file_is_valid_and_covers_every_type() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "cases.jsonl"
    cases = parse_cases(path.read_text(encoding="utf-8").splitlines())
    assert len(cases) >= 30
    scored_types = {c.question_type(q) for c in cases for q in c.expected}
    assert scored_types == {"noul", "choice", "score"}
