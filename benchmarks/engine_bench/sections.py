"""The measured sections: each runs the engine and the baseline side by side."""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from devtools.machine import load_average
from devtools.requests import make_state
from devtools.timing import spread

from benchmarks.engine_bench.baseline import ReferenceBaseline
from benchmarks.engine_bench.engine import _cache_stats, engine_decide_batch
from benchmarks.engine_bench.measure import _peak_rss_mib, _reset_peak_rss
from benchmarks.engine_bench.plans import BenchPlan
from benchmarks.engine_bench.stats import GemmLimits, _round, _speedup, summarize
from benchmarks.engine_bench.workload import Workload, make_questions, request_of_length, request_with_state

# -------------------------------------------------------------------------------------------- runner


@dataclass
class _Context:
    clef: Any
    baseline: ReferenceBaseline
    plan: BenchPlan
    gemm_limits: dict[int, float] | None
    """The GEMM limit (GFLOP/s, the backbone's dtype) over the model's Linear shapes at each latency T."""
    device: torch.device
    seed: int
    progress: Callable[[str], None]
    parity: list[float] = field(default_factory=list)
    int8_limits: dict[int, float] | None = None
    """The int8 GEMM limit (GOP/s) at each latency T where it was measured, for a model with int8 layers."""

    def limit_at(self, tokens: int | None = None) -> GemmLimits | None:
        """The limits at ``tokens`` rows (a latency T: measured there), or with None the best over every T
        measured: a batch or a request of another length is not judged against one length's limit."""
        if not self.gemm_limits:
            return None
        int8 = self.int8_limits or {}
        if tokens is None:
            return GemmLimits(max(self.gemm_limits.values()), max(int8.values(), default=None), None)
        return GemmLimits(self.gemm_limits[tokens], int8.get(tokens), tokens)


def _response_numbers(response: dict[str, Any]) -> list[float]:
    numbers: list[float] = []
    for answer in response["answers"].values():
        for key, value in answer.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                numbers.append(float(value))
            elif key == "probabilities":
                numbers.extend(float(v) for v in value.values())
    return numbers


def _record_parity(context: _Context, engine: dict[str, Any], baseline: dict[str, Any]) -> None:
    """Largest difference between the two sides' rounded answer numbers (they compute the same thing)."""
    left, right = _response_numbers(engine), _response_numbers(baseline)
    if len(left) == len(right):
        context.parity.append(max((abs(a - b) for a, b in zip(left, right, strict=True)), default=0.0))
    else:
        context.parity.append(math.inf)


def _side_by_side(
    context: _Context,
    workloads: Sequence[Sequence[Workload]],
    *,
    baseline_runs: int | None = None,
    tokens: int | None = None,
) -> dict[str, Any]:
    """Run each workload group once on the engine (one batched call) and on the baseline (one request at
    a time), alternating which side goes first; returns both summaries, the speedup and the load average.
    ``tokens``: the request length (a latency T), whose GEMM limits the FLOP fractions use (default: the
    best over every T measured, recorded as ``gemm_limit.tokens`` null)."""
    engine_runs: list[dict[str, float]] = []
    baseline_runs_done: list[dict[str, float]] = []
    engine_peak = baseline_peak = 0.0
    load_before = load_average()
    limit = len(workloads) if baseline_runs is None else baseline_runs
    for index, group in enumerate(workloads):

        def run_engine(group: Sequence[Workload] = group) -> list[dict[str, Any]]:
            nonlocal engine_peak
            _reset_peak_rss()
            responses, timing = engine_decide_batch(context.clef, group)
            timing["requests"] = float(len(group))
            engine_runs.append(timing)
            engine_peak = max(engine_peak, _peak_rss_mib())
            return responses

        def run_baseline(group: Sequence[Workload] = group) -> list[dict[str, Any]]:
            nonlocal baseline_peak
            _reset_peak_rss()
            responses = []
            combined: dict[str, float] = {}
            for workload in group:
                response, timing = context.baseline.decide(workload)
                responses.append(response)
                for key, value in timing.items():
                    combined[key] = combined.get(key, 0.0) + value
            combined["requests"] = float(len(group))
            baseline_runs_done.append(combined)
            baseline_peak = max(baseline_peak, _peak_rss_mib())
            return responses

        if index >= limit:
            run_engine()
            continue
        if index % 2 == 0:
            engine_responses, baseline_responses = run_engine(), run_baseline()
        else:
            baseline_responses, engine_responses = run_baseline(), run_engine()
        for engine_response, baseline_response in zip(engine_responses, baseline_responses, strict=True):
            _record_parity(context, engine_response, baseline_response)
    gemm = context.limit_at(tokens)
    engine = summarize(engine_runs, gemm, engine_peak)
    baseline = summarize(baseline_runs_done, gemm, baseline_peak)
    paired = zip(baseline["spread_s"]["samples"], engine["spread_s"]["samples"][:limit], strict=False)
    return {
        "engine": engine,
        "baseline": baseline,
        "gemm_limit": gemm.as_dict() if gemm else None,
        "speedup_p50": _speedup(engine, baseline),
        # Baseline / engine for each repetition (both sides ran the same workload in it).
        "speedup_spread": spread(ref / own for ref, own in paired if own > 0) if limit else None,
        "speedup_min": round(baseline["min_s"] / engine["min_s"], 2) if engine["min_s"] else None,
        "speedup_cpu_p50": (
            round(baseline["cpu_p50_s"] / engine["cpu_p50_s"], 2) if engine.get("cpu_p50_s") else None
        ),
        "load_average": {"before": load_before, "after": load_average()},
    }


def section_latency(context: _Context) -> dict[str, Any]:
    """One request at a time at each request length of the plan (2 questions each)."""
    results: dict[str, Any] = {}
    for tokens, reps in context.plan.latency_reps.items():
        context.progress(f"latency: {reps} x {tokens}-token requests")
        rng = random.Random(f"{context.seed}-latency-{tokens}")
        groups = [[request_of_length(rng, tokens, 2, f"l{tokens}r{rep}")] for rep in range(reps)]
        results[str(tokens)] = _side_by_side(context, groups, tokens=tokens)
    return results


def section_questions(context: _Context) -> dict[str, Any]:
    """Cost vs the number of questions on a fixed-size state."""
    results: dict[str, Any] = {}
    for count, reps in context.plan.question_reps.items():
        context.progress(f"questions: {reps} x {count} questions")
        rng = random.Random(f"{context.seed}-questions-{count}")
        groups = [
            [request_with_state(rng, context.plan.question_state_tokens, count, f"q{count}r{rep}")]
            for rep in range(reps)
        ]
        results[str(count)] = _side_by_side(context, groups)
    return results


def section_concurrency(context: _Context) -> dict[str, Any]:
    """``concurrency`` requests arriving together: one batched engine call vs sequential baseline calls."""
    results: dict[str, Any] = {}
    count = context.plan.concurrency
    for tokens, reps in context.plan.concurrency_reps.items():
        context.progress(f"concurrency: {reps} x {count} requests of {tokens} tokens")
        rng = random.Random(f"{context.seed}-concurrency-{tokens}")
        groups = [
            [
                # States of 90-110% of the nominal size: concurrent requests rarely have equal lengths.
                request_with_state(rng, rng.randint(tokens * 9 // 10, tokens * 11 // 10), 1, f"c{rep}i{item}")
                for item in range(count)
            ]
            for rep in range(reps)
        ]
        result = _side_by_side(context, groups)
        result["requests"] = count
        for side in ("engine", "baseline"):
            summary = result[side]
            # Every request of the batch completes with the batch; the baseline's i-th request completes
            # after i+1 sequential calls: latencies are completion times from the common arrival.
            summary["request_latency_p50_s"] = _round(
                summary["p50_s"] if side == "engine" else summary["p50_s"] * (count + 1) / (2 * count)
            )
        result["throughput_ratio"] = _round(
            result["engine"]["requests_per_s"] / result["baseline"]["requests_per_s"], 3
        )
        # Fastest repetition of each side (same number of requests per repetition).
        result["throughput_ratio_best"] = _round(result["baseline"]["min_s"] / result["engine"]["min_s"], 3)
        result["throughput_ratio_spread"] = result["speedup_spread"]
        results[str(tokens)] = result
    return results


def _with_peak(peaks: dict[str, float], side: str, call: Callable[[], Any]) -> Any:
    """Run ``call`` with the peak-RSS mark reset first; keep the highest peak seen per ``side``."""
    _reset_peak_rss()
    result = call()
    peaks[side] = max(peaks.get(side, 0.0), _peak_rss_mib())
    return result


def section_state_cache(context: _Context, cache_enabled: bool) -> dict[str, Any]:
    """A 2,000-token state first asked cold, then again with new ~150-token schemas (warm)."""
    plan = context.plan
    rng = random.Random(f"{context.seed}-cache")
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": [], "baseline": []}
    peaks: dict[str, float] = {}
    stats_before = _cache_stats(context.clef)
    load_before = load_average()
    schema_tokens: list[int] = []
    for state_index in range(plan.cache_states):
        context.progress(f"state cache: state {state_index + 1}/{plan.cache_states}")
        state = make_state(rng, plan.cache_state_tokens)

        def workload(tag: str, state: str = state) -> Workload:
            questions = make_questions(rng, plan.cache_schema_questions, tag)
            return Workload({"model": "clef", "state": state, "questions": questions})

        cold_workload = workload(f"s{state_index}cold")
        _, cold = _with_peak(
            peaks, "cold", functools.partial(engine_decide_batch, context.clef, [cold_workload])
        )
        runs["cold"].append(cold)
        for warm_index in range(plan.cache_warm_per_state):
            warm_workload = workload(f"s{state_index}w{warm_index}")
            responses, warm = _with_peak(
                peaks, "warm", functools.partial(engine_decide_batch, context.clef, [warm_workload])
            )
            runs["warm"].append(warm)
            record = context.baseline.encode(warm_workload)[1]
            schema_tokens.append(record.input_tokens - record.state_end)
            if len(runs["baseline"]) < plan.cache_baseline_reps:
                baseline_response, timing = _with_peak(
                    peaks, "baseline", functools.partial(context.baseline.decide, warm_workload)
                )
                runs["baseline"].append(timing)
                _record_parity(context, responses[0], baseline_response)
    # Judged against the best limit over every T measured (the state is not one of the latency lengths).
    limits = context.limit_at()
    summaries = {side: summarize(side_runs, limits, peaks[side]) for side, side_runs in runs.items()}
    warm_p50, warm_min = summaries["warm"]["p50_s"], summaries["warm"]["min_s"]
    return {
        "available": cache_enabled,
        "gemm_limit": limits.as_dict() if limits else None,
        "state_tokens": plan.cache_state_tokens,
        "schema_tokens_p50": statistics.median(schema_tokens),
        **summaries,
        "warm_backbone_tokens_p50": statistics.median(run["backbone_tokens"] for run in runs["warm"]),
        "cold_over_warm": round(summaries["cold"]["p50_s"] / warm_p50, 2),
        "cold_over_warm_min": round(summaries["cold"]["min_s"] / warm_min, 2),
        # Every (cold, warm) pair of the same state: the spread of the speed-up itself.
        "cold_over_warm_spread": spread(
            cold["total_s"] / warm["total_s"]
            for index, cold in enumerate(runs["cold"])
            for warm in runs["warm"][
                index * plan.cache_warm_per_state : (index + 1) * plan.cache_warm_per_state
            ]
        ),
        "baseline_over_warm": round(summaries["baseline"]["p50_s"] / warm_p50, 2),
        "cache_stats_before": stats_before,
        "cache_stats_after": _cache_stats(context.clef),
        "load_average": {"before": load_before, "after": load_average()},
    }


def padding_waste(
    lengths: Sequence[int],
    *,
    length_ratio: float,
    max_step_tokens: int,
    max_rows: int,
) -> dict[str, Any]:
    """Run the engine's step policy (`clef_runtime.engine.policy`) over ``lengths`` (all queued at once, one
    start point) until every request is done, and return the fraction of padded tokens (``1 - real /
    padded``), the number of steps and the mean rows per step. Only the policy's choices are measured: a
    part of ``t`` tokens over ``r`` rows costs ``t x r`` padded tokens, of which each row's own tokens are
    real."""
    from clef_runtime.engine.policy import Admit, Running, StepSettings, Waiting, compose_step

    settings = StepSettings(max_step_tokens=max_step_tokens, max_rows=max_rows, length_ratio=length_ratio)
    waiting = {i: Waiting(key=i, tokens=length, seq=i) for i, length in enumerate(lengths)}
    running: dict[int, dict[int, int]] = {}  # batch key -> row -> tokens left
    keys = iter(range(len(lengths), 1 << 30))
    padded = real = steps = rows = work = 0
    while waiting or running:
        views = [Running(key, tuple(left.values()), seq=min(left)) for key, left in running.items()]
        step = compose_step(list(waiting.values()), views, work_done=work, settings=settings)
        steps, rows, work = steps + 1, rows + step.rows, work + step.tokens
        for part in step.parts:
            if isinstance(part, Admit):
                key = next(keys)
                running[key] = {k: waiting.pop(k).tokens for k in part.keys}
            else:
                key = part.key
            left = running[key]
            padded += part.tokens * len(left)
            real += sum(min(tokens, part.tokens) for tokens in left.values())
            running[key] = {row: tokens - part.tokens for row, tokens in left.items() if tokens > part.tokens}
            if not running[key]:
                del running[key]
    return {
        "steps": steps,
        "mean_rows_per_step": round(rows / steps, 2),
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_fraction": round(1 - real / padded, 4) if padded else 0.0,
    }


def section_padding(
    plan: BenchPlan, seed: int, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Padding waste of a mixed workload (lengths log-uniform in [64, 4096]) with and without grouping."""
    if progress is not None:
        progress("padding: the step policy on a mixed-length workload")
    rng = random.Random(f"{seed}-padding")
    lengths = [
        round(math.exp(rng.uniform(math.log(64), math.log(4096)))) for _ in range(plan.padding_requests)
    ]
    return {
        "requests": len(lengths),
        "lengths": "log-uniform in [64, 4096] tokens, all queued at once",
        "arrival_order": {
            "policy": "16,384-token steps, up to 16 rows, no length limit on a batch",
            **padding_waste(lengths, length_ratio=math.inf, max_step_tokens=16384, max_rows=16),
        },
        "token_budget_only": {
            "policy": "1,024-token steps (the CPU default), no length limit on a batch",
            **padding_waste(lengths, length_ratio=math.inf, max_step_tokens=1024, max_rows=32),
        },
        "length_grouping": {
            "policy": "engine default on CUDA: 16,384-token steps, a batch's longest/shortest <= 2",
            **padding_waste(lengths, length_ratio=2.0, max_step_tokens=16384, max_rows=32),
        },
    }
