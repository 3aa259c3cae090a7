"""Generated request bodies, and how far two sets of answers to them drift apart."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["STATE_WORDS", "answer_vectors", "drift", "generated_requests", "make_state"]

_WORD_TEXT = (
    "account billing refund invoice error crash login password payment card order delivery late "
    "broken screen update server outage slow timeout database backup customer angry happy thanks "
    "please urgent week today tomorrow price discount plan upgrade cancel support ticket email "
    "phone chat bug feature request report data export import sync mobile app desktop browser cache "
    "cookie network the a to of and is was not it we you they my our your this that with for on at "
    "from"
)
_WORDS = tuple(_WORD_TEXT.split())


# Single-token words of the Qwen3.5 vocabulary (with a leading space): a state of n of them is n tokens,
# so request lengths can be set exactly.
_STATE_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will can more other out what "
    "about up some into them could then than only its time over also new these two may first like any after "
    "most made where many our such people way make even back good well very through just year day work state "
    "part long world both each case system group number place week point company fact hand home water room "
    "money month order account billing support data report price service team message request answer problem "
    "issue customer product payment refund delivery error"
)
STATE_WORDS = tuple(_STATE_TEXT.split())


def make_state(rng: random.Random, tokens: int) -> str:
    """A state of ``tokens`` single-token words (exactly ``tokens`` tokens with the Qwen3.5 vocabulary)."""
    return " ".join(rng.choice(STATE_WORDS) for _ in range(max(1, tokens)))


def generated_requests(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` requests: states of 10-200 words (text or a small JSON object), 1-3 questions each
    (noul, choice with 2-6 options, score with 3-5 levels)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(10, 200)))
        state: Any = words if rng.random() < 0.7 else {"ticket": index, "body": words, "tags": ["a", "b"]}
        questions: dict[str, Any] = {}
        for number in range(rng.randint(1, 3)):
            kind = rng.choice(("noul", "choice", "score"))
            if kind == "noul":
                questions[f"q{number}"] = {"type": "noul", "instructions": f"is it {rng.choice(_WORDS)}?"}
            elif kind == "choice":
                options = rng.sample(_WORDS, rng.randint(2, 6))
                questions[f"q{number}"] = {"type": "choice", "criteria": {w: f"about {w}" for w in options}}
            else:
                questions[f"q{number}"] = {"type": "score", "criteria": rng.sample(_WORDS, rng.randint(3, 5))}
        requests.append({"state": state, "questions": questions})
    return requests


def answer_vectors(response: dict[str, Any]) -> list[list[float]]:
    """Each answer's probabilities as a list (a noul answer: [p, 1 - p])."""
    vectors = []
    for answer in response["answers"].values():
        if answer["type"] == "noul":
            vectors.append([answer["noul"], 1.0 - answer["noul"]])
        else:
            vectors.append(list(answer["probabilities"].values()))
    return vectors


def drift(
    reference: Sequence[Sequence[Sequence[float]]], other: Sequence[Sequence[Sequence[float]]]
) -> dict[str, Any]:
    """Max and mean |dp| over every option probability, and top-1 agreement per question, between two sets of
    answers (per request, per question, the probabilities). Raises ValueError when the shapes differ."""
    diffs: list[float] = []
    agree = questions = 0
    for reference_request, other_request in zip(reference, other, strict=True):
        for expected, got in zip(reference_request, other_request, strict=True):
            diffs += [abs(a - b) for a, b in zip(expected, got, strict=True)]
            agree += expected.index(max(expected)) == got.index(max(got))
            questions += 1
    return {
        "max_abs_dp": round(max(diffs), 5),
        "mean_abs_dp": round(statistics.fmean(diffs), 6),
        "top1_agreement": f"{agree}/{questions}",
    }
