"""Paired tests of a change measured on the same held-out questions before and after (docs/tuning.md,
"Is the change real?").

- Correctness: the exact McNemar test (McNemar 1947), i.e. a two-sided binomial test of the discordant pairs
  (questions right before and wrong after vs wrong before and right after) against 1/2.
- Per-question NLL differences (after - before): the sign test (a two-sided binomial test of the number that
  fell among the non-zero ones), the Wilcoxon signed-rank test (Wilcoxon 1945; scipy's), and a paired
  bootstrap percentile interval of the mean difference (Efron & Tibshirani 1993) that resamples whole cases,
  since the questions of one case share a state and are not independent.

Each function returns a JSON-able dict naming its test. Pure numpy/scipy: no model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BOOTSTRAP_RESAMPLES", "mcnemar_exact", "paired_bootstrap", "sign_test", "wilcoxon_signed_rank"]

BOOTSTRAP_RESAMPLES = 10_000


def mcnemar_exact(before: Sequence[bool], after: Sequence[bool]) -> dict[str, Any]:
    """The exact McNemar test of paired correctness: ``b`` questions only right before, ``c`` only right
    after, two-sided p = binomial(b + c, 1/2) test of c (1.0 when no pair is discordant)."""
    from scipy.stats import binomtest

    if len(before) != len(after):
        raise ValueError("mcnemar_exact: before and after differ in length")
    b = sum(1 for x, y in zip(before, after, strict=True) if x and not y)
    c = sum(1 for x, y in zip(before, after, strict=True) if y and not x)
    p = 1.0 if b + c == 0 else float(binomtest(c, b + c, 0.5).pvalue)
    return {
        "test": "exact McNemar (two-sided binomial on discordant pairs)",
        "only_before": b,
        "only_after": c,
        "p_value": p,
    }


def sign_test(differences: Sequence[float]) -> dict[str, Any]:
    """The two-sided sign test of paired differences: how many fell (< 0), rose (> 0) and tied; p of the
    fallen count among the untied under binomial(n, 1/2) (1.0 when all tie)."""
    from scipy.stats import binomtest

    values = np.asarray(differences, dtype=float)
    fell, rose = int((values < 0).sum()), int((values > 0).sum())
    n = fell + rose
    p = 1.0 if n == 0 else float(binomtest(fell, n, 0.5).pvalue)
    return {
        "test": "sign test (two-sided)",
        "decreased": fell,
        "increased": rose,
        "ties": len(values) - n,
        "p_value": p,
    }


def wilcoxon_signed_rank(differences: Sequence[float]) -> dict[str, Any]:
    """The two-sided Wilcoxon signed-rank test of paired differences (zeros dropped; scipy's exact or
    normal-approximation p as it chooses); p 1.0 when every difference is 0."""
    from scipy.stats import wilcoxon

    values = np.asarray(differences, dtype=float)
    if not np.any(values != 0):
        return {"test": "Wilcoxon signed-rank (two-sided)", "statistic": None, "p_value": 1.0}
    result = wilcoxon(values, zero_method="wilcox", alternative="two-sided")
    return {
        "test": "Wilcoxon signed-rank (two-sided)",
        "statistic": float(result.statistic),
        "p_value": float(result.pvalue),
    }


def paired_bootstrap(
    differences: Sequence[float],
    clusters: Sequence[str],
    *,
    seed: int = 0,
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = 0.95,
) -> dict[str, Any]:
    """A percentile interval of the mean paired difference, resampling whole clusters (cases) with
    replacement ``resamples`` times with a seeded generator; also the share of resampled means on the other
    side of 0 from the observed one, doubled (a two-sided bootstrap p, at least 1/resamples)."""
    values = np.asarray(differences, dtype=float)
    if len(values) != len(clusters) or not len(values):
        raise ValueError("paired_bootstrap: one cluster per difference, at least one")
    names = sorted(set(clusters))
    position = {name: i for i, name in enumerate(names)}
    members = np.array([position[c] for c in clusters])
    sums = np.bincount(members, weights=values, minlength=len(names))
    counts = np.bincount(members, minlength=len(names)).astype(float)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(names), size=(resamples, len(names)))
    means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    observed = float(values.mean())
    tail = (1 - level) / 2
    if observed == 0:
        p = 1.0
    else:
        other_side = float(np.mean(means >= 0)) if observed < 0 else float(np.mean(means <= 0))
        p = min(1.0, max(2 * other_side, 1 / resamples))
    return {
        "test": f"paired cluster bootstrap of the mean (by case, {resamples} resamples, percentile interval)",
        "mean": observed,
        "level": level,
        "low": float(np.quantile(means, tail)),
        "high": float(np.quantile(means, 1 - tail)),
        "p_value": p,
        "seed": seed,
    }
