"""The paired tests against their textbook values: exact McNemar and the sign test are binomial tails, the
bootstrap resamples whole cases with a seed and its interval holds the observed mean."""

from __future__ import annotations

import math

import pytest

from clef_runtime.tuning.statistics import mcnemar_exact, paired_bootstrap, sign_test, wilcoxon_signed_rank


def _two_sided_binomial(k: int, n: int) -> float:
    low = min(k, n - k)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(low + 1)) / 2**n)


def test_mcnemar_is_the_binomial_test_of_discordant_pairs() -> None:
    before = [True] * 5 + [False] * 10 + [True] * 2 + [False] * 3
    after = [True] * 5 + [True] * 10 + [False] * 2 + [False] * 3
    result = mcnemar_exact(before, after)
    assert (result["only_before"], result["only_after"]) == (2, 10)
    assert result["p_value"] == pytest.approx(_two_sided_binomial(2, 12))
    assert mcnemar_exact([True, False], [True, False])["p_value"] == 1.0
    with pytest.raises(ValueError):
        mcnemar_exact([True], [])


def test_sign_and_wilcoxon() -> None:
    differences = [-0.5, -0.2, -0.1, -0.3, 0.0, 0.05, -0.4, -0.6, -0.2, -0.1]
    sign = sign_test(differences)
    assert (sign["decreased"], sign["increased"], sign["ties"]) == (8, 1, 1)
    assert sign["p_value"] == pytest.approx(_two_sided_binomial(1, 9))
    assert 0 < wilcoxon_signed_rank(differences)["p_value"] < 0.05
    assert wilcoxon_signed_rank([0.0, 0.0])["p_value"] == 1.0
    assert sign_test([0.0])["p_value"] == 1.0


def test_the_bootstrap_is_seeded_and_clustered() -> None:
    differences = [-0.3, -0.1, -0.2, 0.1, -0.4, -0.2, -0.3, 0.0]
    clusters = ["a", "a", "b", "b", "c", "d", "e", "e"]
    one = paired_bootstrap(differences, clusters, seed=3, resamples=2000)
    assert one == paired_bootstrap(differences, clusters, seed=3, resamples=2000)
    assert one["mean"] == pytest.approx(sum(differences) / 8)
    assert one["low"] <= one["mean"] <= one["high"] < 0
    assert one["p_value"] < 0.05
    # Duplicated clusters only move together: one cluster alone has a degenerate interval.
    single = paired_bootstrap([0.2, -0.1], ["x", "x"], resamples=100)
    assert single["low"] == single["high"] == pytest.approx(0.05)
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], ["a", "b"])
