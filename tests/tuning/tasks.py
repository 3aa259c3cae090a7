"""A synthetic task for tuning tests and measurements: "does this message raise a money matter?" (a noul
question), true exactly when the state contains money keywords (the question itself uses none of them).
Positives and negatives have the same length distribution, so only the keywords tell them apart. The texts
are drawn with a seeded generator, so a seed names a case file; an untrained head knows nothing about it
(chance, ~0.5), a tuned one must learn it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from devtools.explain_tasks import FILLER, MONEY_KEYWORDS, write_cases

KEYWORDS = MONEY_KEYWORDS
#: The default shape: 4 to 8 filler words, and 12 more words inserted at random places: keywords in a
#: positive, filler in a negative (16 to 20 words either way). The tiny model's random backbone carries a
#: single keyword among 20 words too weakly to learn from 150 cases (docs/tuning.md, "Measured"): a
#: positive's words are mostly keywords here.
WORDS = (4, 8)
MENTIONS = 12
#: The task's size: 150 training cases, 60 held out.
TRAIN_CASES, HOLDOUT_CASES = 150, 60
QUESTION = {"billing": {"type": "noul", "instructions": "Does this message raise a money matter?"}}


def billing_case(
    rng: random.Random, number: int, prefix: str, words: tuple[int, int] = WORDS, mentions: int = MENTIONS
) -> dict[str, Any]:
    """One case: ``words`` (low, high) filler words, then ``mentions`` words inserted at random places:
    keywords for a positive (half the cases), filler for a negative, so the classes differ only in them."""
    text = [rng.choice(FILLER) for _ in range(rng.randint(*words))]
    positive = rng.random() < 0.5
    inserted = KEYWORDS if positive else FILLER
    for _ in range(mentions):
        text.insert(rng.randint(1, len(text)), rng.choice(inserted))
    return {
        "id": f"{prefix}-{number}",
        "state": " ".join(text),
        "questions": QUESTION,
        "expected": {"billing": positive},
    }


def billing_cases(count: int, seed: int, prefix: str = "c", **shape: Any) -> list[dict[str, Any]]:
    """``count`` cases drawn with ``seed`` (``shape``: `billing_case`'s ``words`` and ``mentions``)."""
    rng = random.Random(seed)
    return [billing_case(rng, number, prefix, **shape) for number in range(count)]


def write_task_files(directory: Path) -> tuple[Path, Path]:
    """(training file, holdout file) of the keyword task in ``directory``: `TRAIN_CASES` cases of seed 1
    and `HOLDOUT_CASES` of seed 2 (other texts)."""
    return (
        write_cases(directory / "train.jsonl", billing_cases(TRAIN_CASES, 1, "t")),
        write_cases(directory / "holdout.jsonl", billing_cases(HOLDOUT_CASES, 2, "h")),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.tuning.tasks DIR``: writes the tests' keyword task as DIR/train.jsonl (150 cases),
    DIR/holdout.jsonl and DIR/test.jsonl (60 other cases each): README's tuning walk-through."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tests.tuning.tasks DIR", file=sys.stderr)
        return 2
    directory = Path(args[0])
    directory.mkdir(parents=True, exist_ok=True)
    for path in write_task_files(directory):
        print(path)
    print(write_cases(directory / "test.jsonl", billing_cases(HOLDOUT_CASES, 3, "e")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
