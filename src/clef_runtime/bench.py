"""``clef bench``: a quick throughput check of a loaded model, with every engine option.

The CLI loads the model as ``clef decide`` / ``clef serve`` would (the same flags and ``CLEF_*`` variables,
through ``clef_runtime.cli.add_engine_arguments``); `run_bench` then answers ``--requests`` synthetic
requests of ``--state-words`` words of state and two questions, first one at a time, then as one batch, and
returns tokens, seconds, tokens/s and the p50 latency of each way. No baseline, no tables: the side-by-side
comparison with the reference way is developer tooling in ``benchmarks/engine_bench.py`` (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clef_runtime.engine.clef import Clef

__all__ = ["add_bench_arguments", "run_bench", "synthetic_requests"]

_WORDS = ("refund", "charge", "card", "account", "login", "error", "invoice", "late", "broken", "urgent")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the workload size to ``parser`` (the CLI adds ``--model`` and every engine option)."""
    parser.add_argument("--requests", type=int, default=8, metavar="N", help="requests per way (default 8)")
    parser.add_argument(
        "--state-words", type=int, default=200, metavar="N", help="words of state per request (default 200)"
    )


def synthetic_requests(count: int, state_words: int) -> list[dict[str, Any]]:
    """``count`` distinct System One requests (a choice and a score question each); deterministic."""
    requests = []
    for index in range(count):
        words = " ".join(_WORDS[(index + k * 7) % len(_WORDS)] for k in range(state_words))
        requests.append(
            {
                "state": f"ticket {index}: {words}",
                "questions": {
                    "team": {"type": "choice", "criteria": {"billing": "money", "tech": None}},
                    "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
                },
            }
        )
    return requests


def _timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def run_bench(clef: Clef, requests: int, state_words: int) -> dict[str, Any]:
    """Warm ``clef`` up, then answer ``requests`` synthetic requests one at a time and another ``requests``
    (with other states: the state cache must not answer them) as one batch. Returns the JSON result.
    Raises ValueError when ``requests`` < 1 or ``state_words`` < 0."""
    if requests < 1 or state_words < 0:
        raise ValueError("--requests must be at least 1, --state-words at least 0")
    clef.warmup()
    bodies = synthetic_requests(requests, state_words)
    single = [clef.prepare(body) for body in bodies]
    batch = [clef.prepare({**body, "state": "again " + body["state"]}) for body in bodies]
    latencies = [_timed(partial(clef.decide_encoded, [item])) for item in single]
    batch_s = _timed(lambda: clef.decide_encoded(batch))
    tokens = sum(item.input_tokens for item in single)
    batch_tokens = sum(item.input_tokens for item in batch)
    return {
        "model": clef.name,
        "options": {key: value for key, value in vars(clef.options).items() if value is not None},
        "requests": requests,
        "one_at_a_time": {
            "tokens": tokens,
            "seconds": round(sum(latencies), 4),
            "tokens_per_s": round(tokens / sum(latencies), 1),
            "p50_ms": round(statistics.median(latencies) * 1000, 1),
        },
        "batched": {
            "tokens": batch_tokens,
            "seconds": round(batch_s, 4),
            "tokens_per_s": round(batch_tokens / batch_s, 1),
        },
    }
