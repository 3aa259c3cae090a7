"""The figures of a set of runs: spreads, FLOP/s against the GEMM limit, speed-ups."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from devtools.timing import percentile, spread

# ------------------------------------------------------------------------------------------- stats


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class GemmLimits:
    """What the backbone's speed is judged against: the GEMM limit of its floating dtype (GFLOP/s) and, for
    a model with int8 layers, the int8 one (GOP/s; None where it was not measured at the model's shapes),
    both the best over the model's Linear shapes at ``tokens`` rows, or over every length measured when
    ``tokens`` is None."""

    gflops: float
    int8_gops: float | None
    tokens: int | None

    def fraction(self, run: Mapping[str, float]) -> float | None:
        """The time ``run``'s backbone work would take at these limits (its int8 operations at the int8
        one, the rest at the floating one) over the time it took; None when it ran int8 operations and no
        int8 limit was measured."""
        int8 = run.get("int8_flops", 0.0)
        if int8 and not self.int8_gops:
            return None
        ideal_s = (run["flops"] - int8) / (self.gflops * 1e9)
        if int8 and self.int8_gops:
            ideal_s += int8 / (self.int8_gops * 1e9)
        return ideal_s / run["backbone_s"]

    def as_dict(self) -> dict[str, Any]:
        """``{"gflops", "int8_gops", "tokens"}`` (``tokens`` null: the best limit over every T measured)."""
        return {"gflops": self.gflops, "int8_gops": self.int8_gops, "tokens": self.tokens}


def summarize(
    runs: Sequence[dict[str, float]], limits: GemmLimits | None, peak_rss_mib: float
) -> dict[str, Any]:
    """Aggregate timed runs of one side: latency percentiles and spread, throughput, medians of the split,
    the backbone's fraction of the GEMM ``limits`` (median over runs and best run), peak RSS."""
    totals = [run["total_s"] for run in runs]
    seconds = sum(totals)
    summary: dict[str, Any] = {
        "runs": len(runs),
        "tokens_per_run": runs[0]["tokens"],
        "p50_s": _round(percentile(totals, 0.5)),
        "p95_s": _round(percentile(totals, 0.95)),
        "min_s": _round(min(totals)),
        "spread_s": spread(totals),
        "tokens_per_s": round(sum(run["tokens"] for run in runs) / seconds, 1),
        "requests_per_s": round(len(runs) * runs[0].get("requests", 1.0) / seconds, 3),
        "peak_rss_mib": peak_rss_mib,
    }
    if all("cpu_s" in run for run in runs):
        # Process CPU time (all threads): less sensitive than wall time to other jobs on the machine.
        summary["cpu_p50_s"] = _round(statistics.median(run["cpu_s"] for run in runs))
    for part in ("encode_s", "backbone_s", "head_s", "answer_s", "other_s"):
        if all(part in run for run in runs):
            summary[part.replace("_s", "_p50_s")] = _round(statistics.median(run[part] for run in runs), 5)
    backbone = [run for run in runs if run["backbone_s"] > 0 and run["backbone_tokens"] > 0]
    if backbone:
        summary["backbone_tokens_per_s"] = round(
            sum(run["backbone_tokens"] for run in backbone) / sum(run["backbone_s"] for run in backbone), 1
        )
        rates = [run["flops"] / run["backbone_s"] / 1e9 for run in backbone]
        summary["backbone_gflops"] = round(statistics.median(rates), 1)
        fractions = [limits.fraction(run) for run in backbone] if limits else []
        judged = [fraction for fraction in fractions if fraction is not None]
        if judged and len(judged) == len(fractions):
            summary["backbone_gemm_fraction"] = _round(statistics.median(judged))
            # Best run against the best GEMM run: both as little disturbed by other jobs as this run saw.
            summary["backbone_gemm_fraction_spread"] = spread(judged)
            summary["best_backbone_gemm_fraction"] = _round(max(judged))
    non_backbone = [
        (run["total_s"] - run["backbone_s"]) / run["total_s"] for run in runs if run["total_s"] > 0
    ]
    summary["non_backbone_fraction"] = _round(statistics.median(non_backbone))
    fastest = min(runs, key=lambda run: run["total_s"])
    if fastest["total_s"] > 0:
        summary["best_run_non_backbone_fraction"] = _round(
            (fastest["total_s"] - fastest["backbone_s"]) / fastest["total_s"]
        )
    return summary


def _speedup(engine: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    if not engine.get("p50_s") or not baseline.get("p50_s"):
        return None
    return round(baseline["p50_s"] / engine["p50_s"], 2)
