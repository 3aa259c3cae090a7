"""The faithfulness measurement's arithmetic (devtools/faithfulness.py) on an engine whose answer is known:
P(true) grows with the money keywords left in the state, so the keywords are the perfect evidence."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from devtools.explain_tasks import FILLER, MONEY, MONEY_KEYWORDS, TEAM
from devtools.faithfulness import (
    RANDOM,
    CaseEvidence,
    Thresholds,
    explain_cases,
    random_evidence,
    score_method,
)


class KeywordEngine:
    """``decide_many`` like `Clef`'s for the money task: P(true) = 0.1 + 0.8 x (keywords in the state / the
    task's mentions, at most 1); with ``x_explain`` the evidence is the keywords first, then the rest."""

    def decide_many(self, items: Sequence[Mapping[str, Any]], *, explain: Any = None) -> list[dict[str, Any]]:
        return [self._answer(item["state"], explain) for item in items]

    def _answer(self, state: str, explain: Any) -> dict[str, Any]:
        words = state.split(" ") if state else []
        share = min(1.0, sum(word in MONEY_KEYWORDS for word in words) / MONEY.mentions)
        answer: dict[str, Any] = {"type": "noul", "noul": 0.1 + 0.8 * share}
        if explain is not None:
            starts = [sum(len(word) + 1 for word in words[:index]) for index in range(len(words))]
            ranked = sorted(range(len(words)), key=lambda index: words[index] not in MONEY_KEYWORDS)
            answer["x_evidence"] = [
                {"text": words[index], "start": starts[index], "end": starts[index] + len(words[index])}
                for index in ranked[: explain["top_k"]]
            ]
        return {"answers": {"billing": answer}}


def test_keyword_evidence_wins_and_random_evidence_does_not() -> None:
    engine = KeywordEngine()
    cases = MONEY.cases(30, 5)
    decided = explain_cases(engine, "money", MONEY, cases, 5)
    assert all(case.answered == case.label for case in decided)  # the engine decides the task
    row = score_method(engine, "money", MONEY, decided, draws=3, seed=1)
    assert Thresholds().failures(row) == []
    assert row["keyword_recall"] == 1.0 and row["comprehensiveness"] > row["comprehensiveness_random"]
    # Only the positives carry known words: the rates are taken on them, every case's are reported too.
    assert row["rationale_cases"] == sum(case.label is True for case in decided) > 0
    control = score_method(engine, "money", MONEY, random_evidence(decided, 5, 2), draws=3, seed=1)
    assert "keyword_recall" in Thresholds().failures(control), RANDOM


def test_evidence_that_is_not_a_word_of_the_state_is_refused() -> None:
    class Shifted(KeywordEngine):
        def _answer(self, state: str, explain: Any) -> dict[str, Any]:
            body = super()._answer(state, explain)
            for item in body["answers"]["billing"].get("x_evidence", []):
                item["start"] += 1
            return body

    with pytest.raises(ValueError, match="not a word of the state"):
        explain_cases(Shifted(), "money", MONEY, MONEY.cases(2, 5), 3)


def test_the_tasks_classes_differ_only_in_the_inserted_words() -> None:
    for task in (MONEY, TEAM):
        cases = task.cases(300, 3)
        labels = {case["expected"][task.question_id] for case in cases}
        assert labels == set(task.keywords)
        for label in labels:
            lengths = [
                len(case["state"].split()) for case in cases if case["expected"][task.question_id] == label
            ]
            low, high = task.filler_words
            assert min(lengths) == low + task.mentions and max(lengths) == high + task.mentions
        assert not any(set(words) & set(FILLER) for words in task.keywords.values())


def test_a_case_evidence_keeps_the_answer() -> None:
    case = CaseEvidence(("a", "b"), True, True, 0.9, (0,))
    assert random_evidence([case], 5, 1)[0].evidence in {(0, 1), (1, 0)}


def test_the_task_files_command_writes_what_the_tuning_reads(tmp_path: Any) -> None:
    from devtools.explain_tasks import main

    assert main(["team", str(tmp_path), "30"]) == 0
    train = (tmp_path / "train.jsonl").read_text(encoding="utf-8").splitlines()
    holdout = (tmp_path / "holdout.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(train) == 30 and len(holdout) == 60
    assert main(["nope", str(tmp_path)]) == 2 and main(["team", str(tmp_path), "x"]) == 2
