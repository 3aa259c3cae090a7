"""What ``x_explain`` costs: a decision with evidence against the same decision without, at 1k state tokens.

Issue 40's limit: with ``x_explain`` a decision may cost at most 1.3x one without it at 1,000 tokens. The
explanation never runs the backbone again: it re-runs the joint head (`clef_runtime.model.attribution`:
``integrated_gradients`` runs it `IG_STEPS` times forward and backward, ``gradient_x_input`` once,
``attention`` one forward) and maps tokens to spans in pure Python. So its cost does not depend on the
backbone's depth, and the ratio to measure is the release's, whose 32-layer backbone dwarfs the head.

The 9B in fp32 does not fit a small machine beside other work, so the release geometry is built in memory
(`devtools.device_model.build_device_model`: random weights, no file) with the FULL release head (width
1,024, 122 M parameters), the full vocabulary and hidden 4,096, but only ``--layers`` L of the backbone's 32
layers (4 by default, the fewest transformers builds: 3 Gated DeltaNet + 1 full attention, the release's 3:1
pattern). Every call is the real path, ``Clef.decide(body, explain=...)``, on one engine whose executor is
switched from method to method (`explain_method`).

For each question set (1 choice question; 4 questions of mixed types), each repetition decides a fresh state
(a state-cache miss, as a new ticket is) without ``x_explain``: the decision's time ``t``, its backbone time
``b``. Then the same request again as every variant (no ``x_explain``, each method, integrated gradients at
``--ig-steps``; the order rotates per repetition) while the state cache holds the state: a variant's time
minus the no-explain one's on that cached state is the explanation's cost ``e`` (what is left of the
backbone, the schema's tokens, is the same on both sides), and a decision with ``x_explain`` costs
``t + e``. This prices every method on the same state without running the slow backbone once per method.
An untimed round on a short state warms every path first.

Reported per variant: ``e``, ``t + e`` and the ratio ``(t + e) / t`` of each repetition (median, min, max;
and the ratio of the medians); then the same extrapolated to the release's 32 layers, ``t32 = t - b + b *
32 / L``. The measured ratio is an upper bound of the 32-layer one (the same ``e`` over a smaller ``t``); the
extrapolated one assumes the backbone's time grows linearly with its layers (a layer's work does not depend
on its depth; the embedding lookup, scaled too, is microseconds).

The tiny model's ratio is reported too, for completeness: its backbone costs next to nothing, so its ratio
means nothing for a release.

    python -m benchmarks.bench_explain --json benchmarks/results/explain-<date>.json
    python -m benchmarks.bench_explain --smoke --json /tmp/explain.json     # seconds, tiny geometry
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from devtools.device_model import build_device_model
from devtools.requests import make_state
from devtools.results import save, start_report
from devtools.timing import spread

from clef_runtime.model import attribution
from clef_runtime.model.layouts import CLEF_FLASH_GEOMETRY
from clef_runtime.model.tiny import Geometry
from clef_runtime.options import EXPLAIN_METHODS

__all__ = ["CASES", "LIMIT", "Plan", "Variant", "extrapolated", "ig_steps", "main", "measure_model"]

#: Issue 40's limit on (decision with x_explain) / (decision without) at 1k tokens.
LIMIT = 1.3
#: The release's backbone depth, the ratio's denominator is extrapolated to.
RELEASE_LAYERS = CLEF_FLASH_GEOMETRY.layers
#: Layers per group of the 3:1 pattern (3 Gated DeltaNet, then full attention): the depths that can be built.
LAYER_PATTERN = 4
#: Fewer integrated-gradients steps measured beside `IG_STEPS` (the lead weighs cost against faithfulness).
FEWER_IG_STEPS = (8, 4)
#: The state length of the untimed warm-up round (every path once, cheaply).
WARMUP_TOKENS = 64

#: The question sets: one choice question, and four of mixed types.
CASES: dict[str, dict[str, Any]] = {
    "1 choice": {"topic": {"type": "choice", "criteria": {"billing": None, "outage": None, "other": None}}},
    "4 mixed": {
        "urgent": {"type": "noul"},
        "topic": {"type": "choice", "criteria": {"billing": None, "outage": None, "other": None}},
        "tone": {"type": "score", "criteria": ["calm", "annoyed", "angry"]},
        "refund": {"type": "noul"},
    },
}


@dataclass(frozen=True)
class Plan:
    """One model's measurement: its ``geometry`` (as built), the depth ``full_layers`` its backbone time is
    extrapolated to, the state's length, the repetitions of each variant, and the integrated-gradients
    steps of the main measurement (None: the module's `IG_STEPS`; the smoke run takes fewer)."""

    name: str
    geometry: Geometry
    full_layers: int
    state_tokens: int
    repeats: int
    ig_steps: int | None = None


@dataclass(frozen=True)
class Variant:
    """One side of the comparison: ``method`` None (no ``x_explain``) or an attribution method, and the
    integrated-gradients steps it runs with (None: the module's own `IG_STEPS`)."""

    method: str | None
    steps: int | None = None

    @property
    def label(self) -> str:
        if self.method is None:
            return "none"
        return self.method if self.steps is None else f"{self.method}@{self.steps}"


def plans(smoke: bool, layers: int, state_tokens: int, repeats: int) -> list[Plan]:
    """The release geometry with ``layers`` backbone layers, then the tiny model; ``smoke``: the tiny
    geometry in both places (the first extrapolated to twice its 4 layers), a short state, one repetition,
    2 integrated-gradients steps (its figures mean nothing)."""
    tiny = Geometry()
    if smoke:
        return [
            Plan("release", tiny, 2 * tiny.layers, 16, 1, ig_steps=2),
            Plan("tiny", tiny, tiny.layers, 16, 1, ig_steps=2),
        ]
    release = dataclasses.replace(CLEF_FLASH_GEOMETRY, layers=layers)
    return [
        Plan("release", release, RELEASE_LAYERS, state_tokens, repeats),
        Plan("tiny", tiny, tiny.layers, state_tokens, repeats),
    ]


@contextlib.contextmanager
def ig_steps(steps: int | None) -> Iterator[None]:
    """`attribution.IG_STEPS` set to ``steps`` (None: left alone) for the block, then put back."""
    saved = attribution.IG_STEPS
    if steps is not None:
        attribution.IG_STEPS = steps
    try:
        yield
    finally:
        attribution.IG_STEPS = saved


def extrapolated(seconds: float, backbone_s: float, built_layers: int, full_layers: int) -> float:
    """A call's time with its backbone's share scaled from ``built_layers`` to ``full_layers`` layers."""
    return seconds - backbone_s + backbone_s * full_layers / built_layers


def _body(rng: random.Random, state_tokens: int, questions: dict[str, Any]) -> dict[str, Any]:
    """A fresh request: a new state of ``state_tokens`` single-token words (a state-cache miss)."""
    return {"state": make_state(rng, state_tokens), "questions": questions}


@contextlib.contextmanager
def explain_method(engine: Any, method: str | None) -> Iterator[None]:
    """``engine`` explaining with ``method`` (None: left alone) for the block: the engine's executor reads
    ``options.explain_method`` at each explanation, so one engine (one state cache) serves every method."""
    saved = engine.executor.options
    if method is not None:
        engine.executor.options = dataclasses.replace(saved, explain_method=method)
    try:
        yield
    finally:
        engine.executor.options = saved


@dataclass(frozen=True)
class Call:
    """One timed ``decide``: wall and backbone seconds, the state cache's verdict, evidence items answered."""

    seconds: float
    backbone_s: float
    cache: str
    evidence_items: int


def timed_decide(engine: Any, body: dict[str, Any], variant: Variant) -> Call:
    """One ``engine.decide`` of ``body`` as ``variant`` asks. Raises RuntimeError when an explained answer has
    no ``x_evidence`` (the explanation did not run)."""
    with ig_steps(variant.steps), explain_method(engine, variant.method):
        started = time.perf_counter()
        response = engine.decide(body, explain=True if variant.method else None)
        seconds = time.perf_counter() - started
    timings = engine.last_timings
    cache = "hit" if timings.state_hits else "partial" if timings.state_partials else "miss"
    answers = response["answers"].values()
    if variant.method is not None and any("x_evidence" not in answer for answer in answers):
        raise RuntimeError(f"{variant.label}: an answer came back without x_evidence")
    items = sum(len(answer.get("x_evidence", [])) for answer in answers)
    return Call(seconds, timings.backbone_s, cache, items)


def _ms(samples: Sequence[float]) -> dict[str, Any]:
    return spread([value * 1000 for value in samples], digits=2)


def _ratios(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, Any]:
    """The paired ratios (repetition by repetition) with their spread, and the ratio of the medians."""
    paired = spread([n / d for n, d in zip(numerators, denominators, strict=True)], digits=3)
    return {
        "median": paired["median"],
        "min": paired["min"],
        "max": paired["max"],
        "samples": paired["samples"],
        "of_medians": round(statistics.median(numerators) / statistics.median(denominators), 3),
    }


def _round(
    engine: Any, variants: Sequence[Variant], body: dict[str, Any], shift: int
) -> tuple[Call, dict[str, Call]]:
    """One repetition: ``body`` decided without ``x_explain`` on a fresh state (the decision's whole cost),
    then again as each variant (the order rotated by ``shift``), the state served by the state cache."""
    decision = timed_decide(engine, body, Variant(None))
    again = {}
    for variant in [*variants[shift:], *variants[:shift]]:
        again[variant.label] = timed_decide(engine, body, variant)
    return decision, again


def measure_case(
    engine: Any, variants: Sequence[Variant], questions: dict[str, Any], plan: Plan, rng: random.Random
) -> dict[str, Any]:
    """The cost of each variant on ``questions`` at the plan's state length (``variants[0]``: no
    ``x_explain``). Each repetition decides a fresh state without ``x_explain`` (the decision: its wall time
    ``t`` and backbone time ``b``), then the same request again as every variant while the state cache holds
    the state: the explanation's cost ``e`` is a variant's time minus the no-explain variant's on that cached
    state (the backbone work left, the schema's tokens, is the same in both), and the decision with
    ``x_explain`` costs ``t + e``. One untimed round on a short state warms every path first."""
    _round(engine, variants, _body(rng, WARMUP_TOKENS, questions), 0)
    rounds = [
        _round(engine, variants, _body(rng, plan.state_tokens, questions), number % len(variants))
        for number in range(plan.repeats)
    ]
    built = plan.geometry.layers
    plain = [decision.seconds for decision, _ in rounds]
    plain_full = [
        extrapolated(decision.seconds, decision.backbone_s, built, plan.full_layers) for decision, _ in rounds
    ]
    base = variants[0].label
    result: dict[str, Any] = {
        "questions": len(questions),
        "question_types": sorted({question["type"] for question in questions.values()}),
        "without": {
            "ms": _ms(plain),
            "backbone_ms": _ms([decision.backbone_s for decision, _ in rounds]),
            "extrapolated_ms": _ms(plain_full),
            "cache": sorted({decision.cache for decision, _ in rounds}),
        },
        "cached_state": {
            label: {
                "ms": _ms([again[label].seconds for _, again in rounds]),
                "cache": sorted({again[label].cache for _, again in rounds}),
            }
            for label in (variant.label for variant in variants)
        },
    }
    for variant in variants[1:]:
        costs = [again[variant.label].seconds - again[base].seconds for _, again in rounds]
        with_explain = [t + e for t, e in zip(plain, costs, strict=True)]
        with_full = [t + e for t, e in zip(plain_full, costs, strict=True)]
        result[variant.label] = {
            "explain_ms": _ms(costs),
            "ms": _ms(with_explain),
            "ratio": _ratios(with_explain, plain),
            "extrapolated_ms": _ms(with_full),
            "extrapolated_ratio": _ratios(with_full, plain_full),
            "evidence_items": sorted({again[variant.label].evidence_items for _, again in rounds}),
        }
    return result


def measure_model(plan: Plan, device: str, extra_ig_steps: Sequence[int]) -> dict[str, Any]:
    """Build the plan's model and measure every case (see the module docstring), with integrated gradients
    also at each of ``extra_ig_steps``."""
    with ig_steps(plan.ig_steps):
        return _measure_model(plan, device, extra_ig_steps)


def _measure_model(plan: Plan, device: str, extra_ig_steps: Sequence[int]) -> dict[str, Any]:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.options import EngineOptions

    model = build_device_model(plan.geometry, device=device, name=f"{plan.name}-random")
    engine = Clef(model.loaded, EngineOptions(device=str(model.loaded.backbone.device)))
    rng = random.Random(40)
    variants = [
        Variant(None),
        *(Variant(method) for method in EXPLAIN_METHODS),
        *(Variant("integrated_gradients", steps) for steps in extra_ig_steps),
    ]
    started = time.perf_counter()
    cases = {}
    for name, questions in CASES.items():
        cases[name] = measure_case(engine, variants, questions, plan, rng)
        elapsed = time.perf_counter() - started
        print(f"bench_explain {plan.name} {name}: {elapsed:.0f} s", file=sys.stderr, flush=True)
    record = {
        "model": model.record(),
        "built_layers": plan.geometry.layers,
        "extrapolated_to_layers": plan.full_layers,
        "state_tokens": plan.state_tokens,
        "input_tokens": {
            name: engine.prepare(_body(rng, plan.state_tokens, questions)).record.input_tokens
            for name, questions in CASES.items()
        },
        "repeats": plan.repeats,
        "ig_steps": attribution.IG_STEPS,
        "cases": cases,
        "measure_s": round(time.perf_counter() - started, 1),
    }
    del engine, model
    gc.collect()
    return record


def table(models: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model, case and explained variant: medians without / with, ratio and its spread, the
    extrapolated ratio and its spread."""
    rows = []
    for name, record in models.items():
        for case_name, case in record["cases"].items():
            for label, figures in case.items():
                if not isinstance(figures, dict) or "ratio" not in figures:
                    continue
                rows.append(
                    {
                        "model": name,
                        "method": label,
                        "case": case_name,
                        "without_ms": case["without"]["ms"]["median"],
                        "with_ms": figures["ms"]["median"],
                        "explain_ms": figures["explain_ms"]["median"],
                        "ratio": figures["ratio"],
                        "extrapolated_ratio": figures["extrapolated_ratio"],
                        "within_limit": figures["extrapolated_ratio"]["median"] <= LIMIT,
                    }
                )
    return rows


def markdown(rows: Sequence[dict[str, Any]], layers: dict[str, tuple[int, int]]) -> str:
    """The table as markdown (ratios: median of the paired ratios [min, max])."""

    def ratio(figure: dict[str, Any]) -> str:
        return f"{figure['median']:.3f} [{figure['min']:.3f}, {figure['max']:.3f}]"

    lines = [
        "| model (layers built -> extrapolated) | method | questions | without ms | explain ms | with ms "
        "| ratio [min, max] | extrapolated ratio [min, max] |",
        "|---|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        built, full = layers[row["model"]]
        cells = [f"{row['model']} ({built} -> {full})", row["method"], row["case"]]
        cells += [f"{row[key]:.1f}" for key in ("without_ms", "explain_ms", "with_ms")]
        cells += [ratio(row["ratio"]), ratio(row["extrapolated_ratio"])]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="the report (default: a new results file)")
    parser.add_argument(
        "--smoke", "--quick", dest="smoke", action="store_true", help="tiny geometry, seconds"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--layers", type=int, default=4, help="backbone layers of the release built (4)")
    parser.add_argument("--state-tokens", type=int, default=1000, help="tokens of each state (1000)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each variant (3)")
    parser.add_argument(
        "--ig-steps",
        type=int,
        nargs="*",
        default=None,
        help=f"integrated-gradients steps measured besides {attribution.IG_STEPS} (default "
        f"{' '.join(map(str, FEWER_IG_STEPS))}; smoke: 1; none given: none)",
    )
    args = parser.parse_args(argv)
    if args.layers % LAYER_PATTERN or not 0 < args.layers <= RELEASE_LAYERS:
        # transformers' Qwen3.5 needs a full-attention layer, the last of each group of 4.
        parser.error(
            f"--layers must be a multiple of {LAYER_PATTERN} up to {RELEASE_LAYERS}, got {args.layers}"
        )
    if args.state_tokens < 1 or args.repeats < 1:
        parser.error("--state-tokens and --repeats must be >= 1")
    if args.ig_steps is None:
        args.ig_steps = [1] if args.smoke else list(FEWER_IG_STEPS)
    if any(steps < 1 for steps in args.ig_steps):
        parser.error(f"--ig-steps must be >= 1, got {args.ig_steps}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    report = start_report("bench_explain", __file__, argv, quick=args.smoke, device=args.device)
    report.update(limit=LIMIT, methods=list(EXPLAIN_METHODS), extra_ig_steps=args.ig_steps, cases=CASES)
    models = {}
    for plan in plans(args.smoke, args.layers, args.state_tokens, args.repeats):
        models[plan.name] = measure_model(plan, args.device, args.ig_steps)
    report["models"] = models
    report["table"] = table(models)
    layers = {
        name: (record["built_layers"], record["extrapolated_to_layers"]) for name, record in models.items()
    }
    print(markdown(report["table"], layers))
    print(save(report, args.json, "explain"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
