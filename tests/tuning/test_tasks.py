"""The keyword task's command (README's tuning walk-through runs it): three case files that `clef eval`
reads, with both labels present and other texts in each."""

from __future__ import annotations

from pathlib import Path

from clef_runtime.evaluation.cases import load_cases
from tests.tuning.tasks import HOLDOUT_CASES, TRAIN_CASES, main


def test_the_task_command_writes_three_readable_case_files(tmp_path: Path) -> None:
    assert main([str(tmp_path / "task")]) == 0
    sizes = {"train.jsonl": TRAIN_CASES, "holdout.jsonl": HOLDOUT_CASES, "test.jsonl": HOLDOUT_CASES}
    states: list[set[str]] = []
    for name, size in sizes.items():
        cases = load_cases(tmp_path / "task" / name)
        assert len(cases) == size
        assert {case.expected["billing"] for case in cases} == {True, False}
        states.append({case.body["state"] for case in cases})
    assert not (states[0] & states[2]) and not (states[1] & states[2])
    assert main([]) == 2


def test_positives_and_negatives_have_the_same_lengths(tmp_path: Path) -> None:
    assert main([str(tmp_path / "task")]) == 0
    lengths: dict[bool, set[int]] = {True: set(), False: set()}
    for name in ("train.jsonl", "holdout.jsonl", "test.jsonl"):
        for case in load_cases(tmp_path / "task" / name):
            lengths[case.expected["billing"]].add(len(case.body["state"].split()))
    # 4 to 8 filler words + 12 inserted words, keywords or filler: the length says nothing of the label.
    assert lengths[True] == lengths[False] == set(range(16, 21))
