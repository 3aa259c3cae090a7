"""benchmarks.release_bench on CPU (``--smoke``: the tiny geometry, small sizes): every measurement is in the
report, with sane values, and the budget decides how many repetitions run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks.release_bench import SMOKE_PLAN, Requests, measure_bursts, measure_latency

from benchmarks import release_bench
from clef_runtime.engine.clef import Clef


def check_latency(rows: list[dict[str, Any]]) -> None:
    """Every size in order, each measured (times in order) or skipped for the budget; the first measured."""
    assert [row["tokens"] for row in rows] == [SMOKE_PLAN.request_tokens, *SMOKE_PLAN.latency_tokens]
    assert "skipped" not in rows[0] and rows[0]["questions"] == 3
    for row in rows:
        if "skipped" not in row:
            assert (
                row["samples"] >= 1 and 0 < row["min_ms"] <= row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
            )


def test_smoke_reports_every_measurement_for_both_fused_settings(tmp_path: Path) -> None:
    out = tmp_path / "release.json"
    assert release_bench.main(["--device", "cpu", "--smoke", "--budget-s", "20", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"fused_on", "fused_off"}
    for key, run in report["runs"].items():
        assert run["fused"]["asked"] == (key == "fused_on") and run["fused"]["ran"] is False  # CPU: none
        model = run["model"]
        assert (model["layers"], model["hidden"], model["vocab"]) == (4, 64, 248_320)
        assert model["random_weights"] and model["parameters"]["total"] > 0
        assert run["warmup_s"] > 0 and run["peak_memory_gib"] is None  # no CUDA memory to read
        assert len(run["latency"]) == 1 + len(SMOKE_PLAN.latency_tokens)
        check_latency(run["latency"])
        assert [burst["concurrency"] for burst in run["bursts"]] == list(SMOKE_PLAN.concurrency)
        for burst in run["bursts"]:
            low, high = burst["requests_per_s_range"]
            assert 0 < low <= burst["requests_per_s"] <= high and burst["tokens_per_s"] > 0
            assert burst["first_s"] > 0 and len(burst["seconds"]) == max(1, burst["bursts"])
        hit = run["state_hit"]
        assert hit["cache_statuses"]["hit"] == ["hit"]  # the new schema found the whole state cached
        assert hit["hit"]["p50_ms"] > 0 and 0 < hit["miss"]["p50_ms"] <= hit["miss"]["p99_ms"]
        assert run["wall_s"] > 0 and run["peers"]


@pytest.fixture(scope="module")
def tiny_clef() -> Clef:
    return Clef.load("tiny")


def test_without_budget_each_measurement_runs_once_and_the_longer_sizes_are_skipped(tiny_clef: Clef) -> None:
    rows = measure_latency(tiny_clef, Requests(tiny_clef, seed=1), SMOKE_PLAN, allotted=0.0)
    first, *rest = rows
    assert (
        first["samples"] == 1 and first["from_first_run_only"]
    )  # the first size always runs: it sizes the rest
    assert [row["tokens"] for row in rest] == list(SMOKE_PLAN.latency_tokens)
    assert all("skipped" in row for row in rest)
    bursts = measure_bursts(tiny_clef, Requests(tiny_clef, seed=2), SMOKE_PLAN, allotted=0.0)
    assert [(b["concurrency"], b["bursts"], b["from_first_burst_only"]) for b in bursts] == [
        (concurrency, 0, True) for concurrency in SMOKE_PLAN.concurrency
    ]


def test_repetitions_fill_the_time_allotted_up_to_the_most() -> None:
    assert release_bench.repetitions(0.5, 10.0, most=50) == 20
    assert release_bench.repetitions(0.5, 10.0, most=5) == 5
    assert release_bench.repetitions(2.0, 1.0, most=5) == 0
    assert release_bench.repetitions(1.0, -3.0, most=5) == 0


def test_requests_have_the_length_asked(tiny_clef: Clef) -> None:
    requests = Requests(tiny_clef, seed=3)
    for tokens in (SMOKE_PLAN.request_tokens, 512):
        assert tiny_clef.encode(requests.body(tokens, release_bench.QUESTIONS)).input_tokens == tokens


@pytest.mark.parametrize("arguments", [["--budget-s", "0"], ["--weights-typo"]])
def test_bad_arguments_exit_2(arguments: list[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        release_bench.main(["--device", "cpu", "--smoke", "--json", str(tmp_path / "x.json"), *arguments])
    assert exit_info.value.code == 2
