"""The engine's side of each comparison."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from benchmarks.engine_bench.measure import backbone_flops, int8_flops
from benchmarks.engine_bench.workload import Workload

# ------------------------------------------------------------------------------------------ engine


def _engine_prepare(clef: Any, workload: Workload) -> Any:
    """Everything the engine does before the model for one request (``prepare`` where the engine has it,
    else parse + encode); returns an item for ``decide_encoded``."""
    kwargs = {} if workload.max_length is None else {"max_length": workload.max_length}
    prepare = getattr(clef, "prepare", None)
    if callable(prepare):
        return prepare(workload.body, **kwargs)
    parsed = clef.parse(workload.body)
    return parsed, clef.encode(parsed, **kwargs)


def _item_record(item: Any) -> Any:
    return item.record if hasattr(item, "record") else item[1]


def _cache_stats(clef: Any) -> dict[str, Any] | None:
    stats = getattr(clef, "cache_stats", None)
    if not callable(stats):
        return None
    try:
        value = stats()
    except Exception:  # a stats bug must not break the benchmark; the figure is optional
        return None
    return dict(value) if isinstance(value, dict) else {"value": repr(value)}


def engine_decide_batch(
    clef: Any, workloads: Sequence[Workload]
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Answer ``workloads`` with one ``decide_encoded`` call (one request: the ``decide`` path).

    Returns the responses and timings: total, encode, backbone / head / answer (from ``last_timings``),
    the rest, tokens, backbone tokens actually computed (a cache hit computes fewer) and useful FLOPs.
    """
    started = time.perf_counter()
    cpu_started = time.process_time()
    items = [_engine_prepare(clef, workload) for workload in workloads]
    encoded = time.perf_counter()
    tokens_before = clef.backbone_tokens
    responses = [decision.body() for decision in clef.decide_encoded(items)]
    finished = time.perf_counter()
    timings = clef.last_timings
    computed = clef.backbone_tokens - tokens_before
    records = [_item_record(item) for item in items]
    total_tokens = sum(record.input_tokens for record in records)
    backbone_s = float(getattr(timings, "backbone_s", 0.0))
    head_s = float(getattr(timings, "head_s", 0.0))
    answer_s = float(getattr(timings, "answer_s", 0.0))
    # Useful FLOPs of what was computed: tokens served from a cached or shared state (the prompt prefix, a
    # state-cache hit) are taken from the front of the rows, spread evenly; padding is not counted.
    flops = int8 = 0.0
    cached_share = max(0, total_tokens - computed) / len(records)
    for record in records:
        cached = min(record.input_tokens, round(cached_share))
        flops += backbone_flops(clef.backbone.model, record.input_tokens - cached, context=cached)
        int8 += int8_flops(clef.backbone.model, record.input_tokens - cached)
    return responses, {
        "total_s": finished - started,
        "cpu_s": time.process_time() - cpu_started,
        "encode_s": encoded - started,
        "backbone_s": backbone_s,
        "head_s": head_s,
        "answer_s": answer_s,
        "other_s": max(0.0, (finished - encoded) - backbone_s - head_s - answer_s),
        "tokens": float(total_tokens),
        "backbone_tokens": float(computed),
        "flops": flops,
        "int8_flops": int8,
    }
