"""The release's geometry on a device, no download: the figures users compare, inside a time budget.

Builds a random model of Clef-flash's geometry (32 layers, hidden 4,096, the full 248,320-token vocabulary,
the published 122 M-parameter head) directly on the device (`devtools.device_model`: no 19 GB file) and serves
it with ``Clef(model, options)``, the engine the server runs. Then, with the fused DeltaNet kernels on or off:

- **warm-up**: ``Clef.warmup(max_rows=<largest burst>)``, timed;
- **latency**: p50 / p99 of a 291-token 3-question request (the peers' request: Clef-flash through vLLM
  pooling on one A800, 45 ms p50) and of 512, 2k, 8k and 16k-token requests, one at a time, each a fresh
  state (a state-cache miss);
- **bursts**: requests/s and tokens/s of 1, 16, 32 and 64 concurrent 291-token requests, each burst one
  ``decide_encoded`` call that the engine runs in steps as the server's loop does (peers: 28 req/s at 16
  clients, 33 at 32);
- **same state, new schema**: a 2k-token state asked with new questions right after it was answered: the
  state cache serves the state; its latency against the miss (the first ask);
- **peak device memory** (``torch.cuda.max_memory_allocated``, the weights included) and the counted fused
  calls (whether the fused kernels really ran).

Every phase fits ``budget_s``: a first pass of each measurement (recorded apart: it pays for new shapes)
sizes the repetitions of the rest; each measurement records how many ran (>= 3 where the budget allows),
and a size whose first pass would not fit is recorded as skipped. The weights are random: the figures are
speed and memory, never answer quality.

``--smoke`` runs the same code on the tiny geometry with smaller numbers (CPU, seconds; the test suite runs
it): its numbers mean nothing for a GPU.

    python -m benchmarks.release_bench --device cuda --budget-s 240 --json "$OUT/release-bench.json"
    python -m benchmarks.release_bench --device cpu --smoke --json /tmp/release-bench.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from devtools.device_model import DeviceModel, build_device_model
from devtools.flags import add_device_check_arguments
from devtools.requests import STATE_WORDS
from devtools.results import save, start_report

from clef_runtime.model.layouts import CLEF_FLASH_GEOMETRY
from clef_runtime.model.tiny import Geometry

__all__ = ["Plan", "build_release_model", "plan_for", "run_release_benchmark"]

#: What peers publish for the same measurements (the issue's figures), printed beside ours.
PEERS = {
    "clef-flash, vLLM pooling, one A800": {
        "p50_ms_291_tokens_3_questions": 45,
        "requests_per_s": {"16": 28, "32": 33},
    },
    "Clef 27B, MindRouter, one H200": {"ms_313_tokens": {"fused": 76, "not fused": 194}},
}

#: The request users compare: 291 tokens, 3 questions (a yes/no, a choice, a score). The prompt around them
#: takes 284 tokens, so the state is a few words.
QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul"},
    "topic": {"type": "choice", "criteria": {"billing": None, "outage": None, "other": None}},
    "tone": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
}
#: The new questions of the same-state hit (another schema over the same state).
OTHER_QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul"},
    "product": {"type": "choice", "criteria": {"app": None, "website": None, "api": None}},
}


@dataclass(frozen=True)
class Plan:
    """The numbers of one run: the geometry and the sizes measured (the smoke run has smaller ones)."""

    geometry: Geometry
    request_tokens: int
    latency_tokens: tuple[int, ...]
    concurrency: tuple[int, ...]
    hit_tokens: int
    """The length of the state asked again with new questions."""
    most_repetitions: int


RELEASE_PLAN = Plan(CLEF_FLASH_GEOMETRY, 291, (512, 2048, 8192, 16384), (1, 16, 32, 64), 2048, 50)
SMOKE_PLAN = Plan(Geometry(), 291, (384, 512, 768, 1024), (1, 2, 4, 8), 512, 5)


def plan_for(smoke: bool) -> Plan:
    """The release plan, or the smoke plan (the tiny geometry, small sizes, few repetitions)."""
    return SMOKE_PLAN if smoke else RELEASE_PLAN


def build_release_model(device: str, *, smoke: bool, seed: int = 0) -> DeviceModel:
    """The plan's random model built on ``device`` (bf16 backbone on CUDA, fp32 on CPU; fp32 head)."""
    return build_device_model(
        plan_for(smoke).geometry, device=device, seed=seed, name="clef-flash-random" if not smoke else "tiny"
    )


class Budget:
    """A deadline, shared out between phases: each phase gets a share of what is left when it starts."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    def share(self, fraction: float) -> float:
        return self.left() * fraction


def repetitions(seconds_each: float, allotted: float, most: int) -> int:
    """How many more runs of a ``seconds_each`` measurement fit ``allotted`` seconds (0 to ``most``)."""
    return max(0, min(most, int(allotted / max(seconds_each, 1e-6))))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, work: Callable[[], Any]) -> tuple[float, Any]:
    _sync(device)
    started = time.perf_counter()
    result = work()
    _sync(device)
    return time.perf_counter() - started, result


def _summary_ms(samples: Sequence[float]) -> dict[str, Any]:
    """p50 / p99 / min / max in milliseconds of ``samples`` (seconds) and how many there were."""
    values = np.asarray(samples, dtype=np.float64) * 1000.0
    return {
        "samples": len(samples),
        "p50_ms": round(float(np.percentile(values, 50)), 2),
        "p99_ms": round(float(np.percentile(values, 99)), 2),
        "min_ms": round(float(values.min()), 2),
        "max_ms": round(float(values.max()), 2),
    }


class Requests:
    """Request bodies of an exact encoded length, each with a state of its own (fresh: a cache miss)."""

    def __init__(self, clef: Any, seed: int) -> None:
        self.clef = clef
        self.rng = random.Random(seed)
        self.tag = 0

    def body(self, tokens: int, questions: dict[str, Any]) -> dict[str, Any]:
        """A request of ``questions`` whose encoding is ``tokens`` long (its schema's length if longer)."""
        self.tag += 1
        prefix = f"case {self.tag}:"
        base = self.clef.encode({"state": prefix, "questions": questions}).input_tokens
        words = [self.rng.choice(STATE_WORDS) for _ in range(max(0, tokens - base))]
        body = {"state": " ".join([prefix, *words]), "questions": questions}
        # Single-token words make the length exact but for the joins; trim what a merge added.
        while words and self.clef.encode(body).input_tokens > tokens:
            words.pop()
            body = {"state": " ".join([prefix, *words]), "questions": questions}
        return body

    def prepared(self, tokens: int, questions: dict[str, Any] = QUESTIONS) -> Any:
        return self.clef.prepare(self.body(tokens, questions))


def _latency(
    clef: Any, requests: Requests, tokens: int, questions: int, allotted: float, most: int
) -> dict[str, Any]:
    """One size's latency: a first run (new shapes), then as many as fit ``allotted``."""
    device = clef.backbone.device
    first, _ = _timed(device, lambda: clef.decide_encoded([requests.prepared(tokens)]))
    samples = []
    for _ in range(repetitions(first, allotted - first, most)):
        item = requests.prepared(tokens)
        samples.append(_timed(device, functools.partial(clef.decide_encoded, [item]))[0])
    tokens_run = int(clef.last_timings.backbone_tokens + clef.last_timings.cached_tokens)
    return {
        "tokens": tokens_run,
        "questions": questions,
        "first_ms": round(first * 1000, 2),
        **_summary_ms(samples or [first]),
        "from_first_run_only": not samples,
    }


def measure_latency(clef: Any, requests: Requests, plan: Plan, allotted: float) -> list[dict[str, Any]]:
    """Latency of the plan's 291-token 3-question request and of each size, ``allotted`` seconds shared
    equally; a size whose first run (estimated from the previous size, linearly in tokens) would not fit what
    is left is recorded as skipped."""
    deadline = time.perf_counter() + allotted
    sizes = [plan.request_tokens, *plan.latency_tokens]
    results: list[dict[str, Any]] = []
    previous: tuple[int, float] | None = None
    for number, tokens in enumerate(sizes):
        left = deadline - time.perf_counter()
        estimate = previous[1] * tokens / previous[0] if previous else 0.0
        if previous and estimate > left:  # the first size always runs: it sizes the rest
            results.append({"tokens": tokens, "skipped": f"first run ~{estimate:.1f} s > {left:.1f} s left"})
            continue
        share = left / (len(sizes) - number)
        result = _latency(clef, requests, tokens, len(QUESTIONS), share, plan.most_repetitions)
        results.append(result)
        previous = (tokens, result["first_ms"] / 1000)
    return results


def _burst_once(clef: Any, requests: Requests, tokens: int, concurrency: int) -> tuple[float, int]:
    items = [requests.prepared(tokens) for _ in range(concurrency)]
    seconds, _ = _timed(clef.backbone.device, lambda: clef.decide_encoded(items))
    return seconds, sum(item.record.input_tokens for item in items)


def measure_bursts(clef: Any, requests: Requests, plan: Plan, allotted: float) -> list[dict[str, Any]]:
    """Requests/s and tokens/s of bursts of each concurrency (one ``decide_encoded`` call each): a first
    burst, then as many as fit an equal share of ``allotted``."""
    deadline = time.perf_counter() + allotted
    results = []
    for number, concurrency in enumerate(plan.concurrency):
        share = (deadline - time.perf_counter()) / (len(plan.concurrency) - number)
        first, tokens = _burst_once(clef, requests, plan.request_tokens, concurrency)
        runs = [
            _burst_once(clef, requests, plan.request_tokens, concurrency)
            for _ in range(repetitions(first, share - first, plan.most_repetitions))
        ]
        seconds = [s for s, _ in runs] or [first]
        rates = [concurrency / s for s in seconds]
        token_rates = [t / s for s, t in (runs or [(first, tokens)])]
        results.append(
            {
                "concurrency": concurrency,
                "request_tokens": plan.request_tokens,
                "bursts": len(runs),
                "first_s": round(first, 4),
                "seconds": [round(s, 4) for s in seconds],
                "requests_per_s": round(statistics.median(rates), 1),
                "requests_per_s_range": [round(min(rates), 1), round(max(rates), 1)],
                "tokens_per_s": round(statistics.median(token_rates), 1),
                "from_first_burst_only": not runs,
            }
        )
    return results


def measure_state_hit(clef: Any, requests: Requests, plan: Plan, allotted: float) -> dict[str, Any]:
    """A fresh state asked (a miss), then the same state with new questions (the state cache serves it):
    both latencies, as many pairs as fit ``allotted`` (at least one)."""
    device = clef.backbone.device
    misses: list[float] = []
    hits: list[float] = []
    statuses: dict[str, list[str]] = {"miss": [], "hit": []}
    deadline = time.perf_counter() + allotted
    while not misses or (
        time.perf_counter() + misses[-1] + hits[-1] < deadline and len(misses) < plan.most_repetitions
    ):
        body = requests.body(plan.hit_tokens, QUESTIONS)
        first = clef.prepare(body)
        again = clef.prepare({**body, "questions": OTHER_QUESTIONS})
        for samples, item, key in ((misses, first, "miss"), (hits, again, "hit")):
            seconds, decisions = _timed(device, functools.partial(clef.decide_encoded, [item]))
            samples.append(seconds)
            statuses[key].append(decisions[0].cache.status)
    miss, hit = _summary_ms(misses), _summary_ms(hits)
    return {
        "state_tokens": plan.hit_tokens,
        "miss": miss,
        "hit": hit,
        "hit_vs_miss": round(hit["p50_ms"] / miss["p50_ms"], 3) if miss["p50_ms"] else None,
        "cache_statuses": {key: sorted(set(values)) for key, values in statuses.items()},
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({device})"


def run_release_benchmark(
    device: str,
    *,
    fused: bool,
    budget_s: float,
    smoke: bool,
    weights: str = "auto",
    model: DeviceModel | None = None,
) -> dict[str, Any]:
    """Measure the plan's model on ``device`` with the fused DeltaNet kernels on or off (``fused``) within
    ``budget_s`` seconds (the model's build included when ``model`` is None: pass one built by
    `build_release_model` to measure it twice without building it again).

    ``weights``: ``auto`` (the model's dtype: bf16 on CUDA); other modes are not built here. Returns the
    report: ``model`` (geometry, parameter counts, dtypes, device, random weights), ``device``, ``fused``
    (asked, and the counted calls), ``warmup_s``, ``latency`` (per size: p50/p99/min/max ms, samples),
    ``bursts`` (per concurrency: requests/s and tokens/s, their range, bursts run), ``state_hit`` (miss and
    hit latency), ``peak_memory_gib`` (CUDA; None elsewhere), ``budget_s``, ``wall_s``, ``peers``. Raises
    ValueError for a weights mode other than ``auto``."""
    if weights != "auto":
        raise ValueError(f"weights: only 'auto' (the model's dtype) is built in memory, got {weights!r}")
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.fused import fused_kernels_status, reset_fused_call_counts, set_fused_kernels
    from clef_runtime.options import EngineOptions

    started = time.perf_counter()
    budget = Budget(budget_s)
    plan = plan_for(smoke)
    model = model or build_release_model(device, smoke=smoke)
    target = model.loaded.backbone.device
    if target.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(target)
    if target.type != "cpu":
        set_fused_kernels(fused)
    reset_fused_call_counts()
    longest = max(plan.latency_tokens)
    options = EngineOptions(device=str(target), max_length=longest + 1024, fused_kernels=fused)
    clef = Clef(model.loaded, options)
    warmup_s, _ = _timed(target, functools.partial(clef.warmup, max_rows=max(plan.concurrency)))
    requests = Requests(clef, seed=17)
    report: dict[str, Any] = {
        "model": model.record(),
        "device": _device_name(target),
        "fused": {"asked": fused},
        "step_tokens": clef.step_tokens,
        "warmup_s": round(warmup_s, 3),
        "latency": measure_latency(clef, requests, plan, budget.share(0.45)),
        "bursts": measure_bursts(clef, requests, plan, budget.share(0.75)),
        "state_hit": measure_state_hit(clef, requests, plan, budget.share(0.8)),
    }
    status = fused_kernels_status()
    fused_calls = sum(counts["fused"] for counts in status["calls"].values())
    report["fused"].update(packages=status["packages"], calls=status["calls"], ran=fused_calls > 0)
    report["peak_memory_gib"] = (
        round(torch.cuda.max_memory_allocated(target) / 2**30, 2) if target.type == "cuda" else None
    )
    report.update(budget_s=budget_s, wall_s=round(time.perf_counter() - started, 2), peers=PEERS)
    del clef
    gc.collect()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where the report goes (JSON)")
    add_device_check_arguments(parser, "the tiny geometry, small sizes (CPU, seconds)")
    parser.add_argument(
        "--budget-s", type=float, default=240.0, help="seconds for everything, both fused settings (240)"
    )
    parser.add_argument(
        "--fused", choices=("both", "on", "off"), default="both", help="fused DeltaNet kernels (both)"
    )
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu --smoke)")
    report = start_report("release_bench", __file__, argv, quick=args.smoke, device=args.device)
    budget = Budget(args.budget_s)
    model = build_release_model(args.device, smoke=args.smoke)
    settings = {"both": (True, False), "on": (True,), "off": (False,)}[args.fused]
    report["runs"] = {}
    for number, fused in enumerate(settings):
        share = budget.left() / (len(settings) - number)
        run = run_release_benchmark(args.device, fused=fused, budget_s=share, smoke=args.smoke, model=model)
        report["runs"]["fused_on" if fused else "fused_off"] = run
        print(
            f"release_bench fused={'on' if fused else 'off'}: {run['wall_s']} s", file=sys.stderr, flush=True
        )
    save(report, args.json, "release_bench")
    print(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
