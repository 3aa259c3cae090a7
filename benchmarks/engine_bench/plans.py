"""The run plans: which sizes and how many repetitions each mode measures."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("engine_bench")

SECTIONS = ("gemm", "latency", "questions", "state_cache", "concurrency", "padding")
MODES = ("quick", "default", "full")

#: The state-cache budget the engine gets unless ``--cache-mb`` says otherwise (MiB).
DEFAULT_CACHE_MB = 256.0


# ---------------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class BenchPlan:
    """How much of each section a mode runs. ``*_reps`` map a size to its number of repetitions."""

    gemm_repeats: int
    latency_reps: dict[int, int]
    question_reps: dict[int, int]
    question_state_tokens: int
    cache_states: int
    cache_warm_per_state: int
    cache_baseline_reps: int
    concurrency_reps: dict[int, int]
    concurrency: int = 16
    cache_state_tokens: int = 2000
    cache_schema_questions: int = 2
    padding_requests: int = 256


PLANS: dict[str, BenchPlan] = {
    "quick": BenchPlan(
        gemm_repeats=3,
        latency_reps={256: 2, 512: 3, 1024: 1},
        question_reps={1: 1, 8: 1},
        question_state_tokens=256,
        cache_states=1,
        cache_warm_per_state=2,
        cache_baseline_reps=1,
        concurrency_reps={100: 1},
    ),
    "default": BenchPlan(
        gemm_repeats=3,
        latency_reps={256: 5, 512: 5, 1024: 3, 4096: 3},
        question_reps={1: 3, 8: 3, 64: 1},
        question_state_tokens=256,
        cache_states=3,
        cache_warm_per_state=3,
        cache_baseline_reps=3,
        concurrency_reps={100: 3, 1000: 3},
    ),
    "full": BenchPlan(
        gemm_repeats=5,
        latency_reps={256: 7, 512: 9, 1024: 5, 4096: 3, 16384: 1},
        question_reps={1: 5, 8: 5, 64: 3},
        question_state_tokens=256,
        cache_states=3,
        cache_warm_per_state=4,
        cache_baseline_reps=3,
        concurrency_reps={100: 5, 1000: 2},
    ),
}
