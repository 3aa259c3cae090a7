"""Tasks whose label is decided by known words, for tuning a head and measuring how faithful its evidence is.

Each case is a few filler words with ``mentions`` words inserted at random places: the keywords of its class,
or (for a class without keywords, a noul question's false side) more filler. Every class has the same length
distribution, so only the inserted words tell the classes apart, and a faithful explanation of a tuned head's
answer must point at them. The filler and the money keywords are also the tuning tests' keyword task
(tests/tuning/tasks.py imports them from here: tests, benchmarks and scripts share devtools).

- `MONEY`: "does this message raise a money matter?" (noul; true exactly when money keywords were inserted);
- `TEAM`: "which team should handle this message?" (choice: shipping or access, each class with its own eight
  keywords, none of them money words).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FILLER",
    "MONEY",
    "MONEY_KEYWORDS",
    "TASKS",
    "TEAM",
    "KeywordTask",
    "answered_label",
    "write_cases",
]

MONEY_KEYWORDS = (
    "invoice",
    "refund",
    "charged",
    "payment",
    "billing",
    "receipt",
    "overdue",
    "subscription",
    "credit",
    "price",
)
_FILLER_TEXT = (
    "the team met on monday to talk about the new office layout and the printer on the second floor "
    "my laptop is slow since the update and the screen flickers when i open the calendar "
    "please move our weekly meeting to thursday afternoon because the room is booked "
    "the delivery of the chairs arrived late and one box was left at the front desk "
    "can someone reset my password for the project wiki i cannot log in from home "
    "lunch will be served in the kitchen and there are sandwiches for everyone today"
)
FILLER = tuple(_FILLER_TEXT.split())

# The choice task's classes: disjoint keyword sets, none of them a filler word.
_TEAM_KEYWORDS = {
    "billing": ("invoice", "refund", "charged", "payment", "receipt", "overdue", "subscription", "price"),
    "shipping": ("parcel", "courier", "tracking", "shipment", "dispatch", "warehouse", "package", "freight"),
    "access": (
        "login",
        "locked",
        "permission",
        "credentials",
        "username",
        "unlock",
        "authentication",
        "signin",
    ),
}


@dataclass(frozen=True)
class KeywordTask:
    """One task: a single question (``question_id``: its spec) and, per label (True / False for a noul, the
    option for a choice), the keywords inserted into that label's cases (empty: filler is inserted)."""

    name: str
    question_id: str
    question: Mapping[str, Any]
    keywords: Mapping[Any, tuple[str, ...]]
    #: (fewest, most) filler words before the insertions, and how many words are inserted. Two mentions
    #: among 12-20 words: the tiny model's tuned head then reads them from the state's rows (measured in
    #: docs/explain.md; with six among 8-12 it also decided from how the random backbone pooled the state
    #: into the question's rows, which no head-only attribution can see).
    filler_words: tuple[int, int] = (12, 20)
    mentions: int = 2

    def case(self, rng: random.Random, number: int, prefix: str) -> dict[str, Any]:
        """One case: its label drawn uniformly, the filler, then `mentions` words of the label inserted."""
        label = rng.choice(list(self.keywords))
        inserted = self.keywords[label] or FILLER
        words = [rng.choice(FILLER) for _ in range(rng.randint(*self.filler_words))]
        for _ in range(self.mentions):
            words.insert(rng.randint(1, len(words)), rng.choice(inserted))
        return {
            "id": f"{prefix}-{number}",
            "state": " ".join(words),
            "questions": {self.question_id: dict(self.question)},
            "expected": {self.question_id: label},
        }

    def cases(self, count: int, seed: int, prefix: str = "c") -> list[dict[str, Any]]:
        """``count`` cases drawn with ``seed`` (a seed names a case file)."""
        rng = random.Random(seed)
        return [self.case(rng, number, prefix) for number in range(count)]


def answered_label(answer: Mapping[str, Any]) -> tuple[Any, float]:
    """(label answered, its probability) of one wire answer: a noul's side (true when P(true) >= 0.5, as the
    engine answers it) or a choice's option."""
    if answer["type"] == "noul":
        probability = float(answer["noul"])
        return (True, probability) if probability >= 0.5 else (False, 1.0 - probability)
    return answer["choice"], float(answer["probabilities"][answer["choice"]])


def label_probability(answer: Mapping[str, Any], label: Any) -> float:
    """The probability that one wire answer gives ``label`` (a noul's side or a choice's option)."""
    if answer["type"] == "noul":
        probability = float(answer["noul"])
        return probability if label is True else 1.0 - probability
    return float(answer["probabilities"][label])


def write_cases(path: Path, cases: list[dict[str, Any]]) -> Path:
    """Writes ``cases`` as a case file (one JSON object per line)."""
    path.write_text("".join(json.dumps(case) + "\n" for case in cases), encoding="utf-8")
    return path


MONEY = KeywordTask(
    name="money",
    question_id="billing",
    question={"type": "noul", "instructions": "Does this message raise a money matter?"},
    keywords={True: MONEY_KEYWORDS, False: ()},
)
TEAM = KeywordTask(
    name="team",
    question_id="team",
    question={
        "type": "choice",
        "instructions": "Which team should handle this message?",
        "criteria": {"shipping": "deliveries of goods", "access": "signing in and permissions"},
    },
    # Two of the three keyword sets: with two mentions among 12-20 words, the tiny model's head tuned on
    # 1,200 cases reached 0.82 held out on all three classes, too weak a head to measure evidence on.
    keywords={team: _TEAM_KEYWORDS[team] for team in ("shipping", "access")},
)
TASKS = {task.name: task for task in (MONEY, TEAM)}


def main(argv: list[str] | None = None) -> int:
    """``python -m devtools.explain_tasks TASK DIR [TRAIN]``: writes TASK's DIR/train.jsonl (TRAIN cases, 1200
    by default; seed 1) and DIR/holdout.jsonl (60 other cases; seed 2): README's "Why this answer"."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3) or args[0] not in TASKS or (len(args) == 3 and not args[2].isdigit()):
        print(f"usage: python -m devtools.explain_tasks {{{','.join(TASKS)}}} DIR [TRAIN]", file=sys.stderr)
        return 2
    task, directory = TASKS[args[0]], Path(args[1])
    directory.mkdir(parents=True, exist_ok=True)
    train = int(args[2]) if len(args) == 3 else 1200
    print(write_cases(directory / "train.jsonl", task.cases(train, 1, "t")))
    print(write_cases(directory / "holdout.jsonl", task.cases(60, 2, "h")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
