"""Determinism measurement on an engine (the tiny model in CI and for RELIABILITY.md).

Over varied requests it reports the largest probability difference between

* a request answered in a batch (random groups of 2-8 requests of different lengths, so padded) and the
  same request answered alone, both with an empty state cache;
* a request answered from the state cache (its state stored by a first, cold answer) and cold;

and whether answering the same request alone twice gives identical response bytes.

Run ``python -m tests.reliability.determinism --requests 200`` from the repository root for the figures in
RELIABILITY.md (prints JSON). The probabilities compared are the engine's unrounded ones (read through
``Clef._probabilities``, the step before the 4-decimal rounding of the wire format); the wire values are
compared too.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from clef_runtime.engine.clef import Clef

WORDS = [
    *("charged", "twice", "refund", "please", "my", "card", "was", "declined", "login", "fails", "again"),
    *("the", "invoice", "is", "late", "shipping", "broken", "screen", "urgent", "today", "tomorrow"),
    *("maybe", "cancel", "subscription", "upgrade", "plan"),
]


def varied_requests(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` System One bodies: 1-4 questions of every type, 2-6 options, states of 3-250 words, text
    or object states. Deterministic in ``seed``."""
    rng = random.Random(seed)
    bodies: list[dict[str, Any]] = []
    for index in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 250)))
        state: Any = (
            text if rng.random() < 0.7 else {"ticket": index, "body": text, "vip": rng.random() < 0.5}
        )
        questions: dict[str, Any] = {}
        for number in range(rng.randint(1, 4)):
            kind = rng.choice(["noul", "choice", "score"])
            options = rng.sample(["billing", "tech", "sales", "legal", "support", "abuse"], rng.randint(2, 6))
            question: dict[str, Any] = {
                "type": kind,
                "instructions": f"question {number}: {rng.choice(WORDS)}?",
            }
            if kind == "choice":
                question["criteria"] = {option: rng.choice([None, f"about {option}"]) for option in options}
            elif kind == "score":
                question["criteria"] = [f"level {i}" for i in range(len(options))]
            questions[f"{kind}_{number}"] = question
        bodies.append({"state": state, "questions": questions})
    return bodies


def _flat(probabilities: list[list[float]]) -> list[float]:
    return [p for question in probabilities for p in question]


def _max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    flat_a, flat_b = _flat(a), _flat(b)
    assert len(flat_a) == len(flat_b)
    return max(abs(x - y) for x, y in zip(flat_a, flat_b, strict=True))


def _wire_values(response: dict[str, Any]) -> list[float]:
    values: list[float] = []
    for answer in response["answers"].values():
        if answer["type"] == "noul":
            values.append(answer["noul"])
        else:
            values.extend(answer["probabilities"].values())
    return values


@dataclass
class DeterminismReport:
    """The figures of one measurement."""

    requests: int
    batches: int
    probabilities_compared: int
    max_batched_vs_alone: float
    max_batched_vs_alone_wire: float
    max_cache_hit_vs_cold: float
    max_cache_hit_vs_cold_wire: float
    cache_hits: int
    repeat_bytes_identical: bool


def measure(engine: Clef, bodies: Sequence[dict[str, Any]], seed: int = 0) -> DeterminismReport:
    """Measure ``engine`` on ``bodies`` (see the module docstring). ``engine`` must have a state cache
    (``cache_mb`` > 0). Returns the report."""
    rng = random.Random(seed)
    prepared = [engine.prepare(body) for body in bodies]

    # Alone and cold: the reference answers.
    cold: list[list[list[float]]] = []
    cold_wire: list[list[float]] = []
    repeat_identical = True
    for item in prepared:
        engine.clear_cache()
        probabilities = engine.probabilities_encoded([item])[0]
        engine.clear_cache()
        response = engine.decide_many([item])[0]
        engine.clear_cache()
        again = engine.decide_many([item])[0]
        repeat_identical &= json.dumps(response).encode() == json.dumps(again).encode()
        cold.append(probabilities)
        cold_wire.append(_wire_values(response))

    # Batched (cold), in random groups of 2-8.
    order = list(range(len(prepared)))
    rng.shuffle(order)
    batched_max = batched_wire_max = 0.0
    batches = 0
    position = 0
    while position < len(order):
        group = order[position : position + rng.randint(2, 8)]
        position += len(group)
        batches += 1
        engine.clear_cache()
        probabilities = engine.probabilities_encoded([prepared[i] for i in group])
        engine.clear_cache()
        responses = engine.decide_many([prepared[i] for i in group])
        for index, probs, response in zip(group, probabilities, responses, strict=True):
            batched_max = max(batched_max, _max_difference(probs, cold[index]))
            wire = _wire_values(response)
            batched_wire_max = max(
                batched_wire_max, max(abs(a - b) for a, b in zip(wire, cold_wire[index], strict=True))
            )

    # Cache hit vs cold: store each state with a first answer, then answer again from the cache.
    hit_max = hit_wire_max = 0.0
    hits_before = engine.cache_stats()["hits"]
    for index, item in enumerate(prepared):
        engine.clear_cache()
        engine.probabilities_encoded([item])  # cold: stores the state
        probabilities = engine.probabilities_encoded([item])[0]  # a hit
        response = engine.decide_many([item])[0]  # a hit
        hit_max = max(hit_max, _max_difference(probabilities, cold[index]))
        wire = _wire_values(response)
        hit_wire_max = max(hit_wire_max, max(abs(a - b) for a, b in zip(wire, cold_wire[index], strict=True)))
    hits = engine.cache_stats()["hits"] - hits_before

    return DeterminismReport(
        requests=len(prepared),
        batches=batches,
        probabilities_compared=sum(len(_flat(c)) for c in cold),
        max_batched_vs_alone=batched_max,
        max_batched_vs_alone_wire=round(batched_wire_max, 6),
        max_cache_hit_vs_cold=hit_max,
        max_cache_hit_vs_cold_wire=round(hit_wire_max, 6),
        cache_hits=hits,
        repeat_bytes_identical=repeat_identical,
    )


def main(argv: list[str] | None = None) -> int:
    """Load the model, measure, print the JSON report. Returns 0."""
    parser = argparse.ArgumentParser(description="Measure batched/unbatched and cache hit/cold differences")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    engine = Clef.load(args.model, cache_mb=256)
    report = measure(engine, varied_requests(args.requests, args.seed), args.seed)
    print(json.dumps(asdict(report), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
