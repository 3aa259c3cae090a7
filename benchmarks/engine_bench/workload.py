"""The generated requests: states of a given length and question sets."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from devtools.requests import STATE_WORDS, make_state

# ----------------------------------------------------------------------------------------- workload


def make_questions(rng: random.Random, count: int, tag: str) -> dict[str, Any]:
    """``count`` short questions cycling noul / choice / score (about 70-75 tokens each with the prompt's
    field scaffolding); ``tag`` makes the schema text unique."""
    questions: dict[str, Any] = {}
    for index in range(count):
        kind = ("noul", "choice", "score")[index % 3]
        name = f"{kind[0]}{index}"
        topic = rng.choice(STATE_WORDS)
        if kind == "noul":
            questions[name] = {
                "type": "noul",
                "instructions": f"Is the {topic} issue resolved? {tag}",
                "criteria": {"true": "yes", "false": "no"},
            }
        elif kind == "choice":
            questions[name] = {
                "type": "choice",
                "instructions": f"Which team handles the {topic}? {tag}",
                "criteria": {"billing": "charges", "technical": None, "sales": None},
            }
        else:
            questions[name] = {
                "type": "score",
                "instructions": f"How urgent is the {topic}? {tag}",
                "criteria": ["low", "medium", "high"],
            }
    return questions


@dataclass(frozen=True)
class Workload:
    """One request body and the ``max_length`` it is encoded with (None: the engine's default)."""

    body: dict[str, Any]
    max_length: int | None = None


def request_of_length(rng: random.Random, total_tokens: int, questions: int, tag: str) -> Workload:
    """A request that encodes to exactly ``total_tokens`` tokens: the state is made long enough and
    truncated by the encoder's ``max_length`` (the reference's own rule: the state loses its tail).
    ``total_tokens`` must exceed the prompt scaffolding and the schema (~55 + ~75 per question)."""
    body = {
        "model": "clef",
        "state": make_state(rng, total_tokens),
        "questions": make_questions(rng, questions, tag),
    }
    return Workload(body, max_length=total_tokens)


def request_with_state(rng: random.Random, state_tokens: int, questions: int, tag: str) -> Workload:
    """A request with a ``state_tokens``-token state and ``questions`` questions (length = state + schema)."""
    body = {
        "model": "clef",
        "state": make_state(rng, state_tokens),
        "questions": make_questions(rng, questions, tag),
    }
    return Workload(body)
