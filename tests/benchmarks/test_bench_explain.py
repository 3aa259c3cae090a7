"""benchmarks.bench_explain ``--smoke`` (the tiny geometry, seconds): the report holds every model, question
set and method with its spread and ratios, the explained calls really answered evidence, and the
explanation's cost was priced on a cached state. Timings are not checked: they mean nothing here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.bench_explain import CASES, LIMIT, extrapolated, ig_steps, main

from clef_runtime.model import attribution
from clef_runtime.options import EXPLAIN_METHODS

SPREAD_KEYS = {"n", "median", "min", "max", "q1", "q3", "samples"}
RATIO_KEYS = {"median", "min", "max", "samples", "of_medians"}


def test_smoke_reports_every_model_case_and_method(tmp_path: Path) -> None:
    out = tmp_path / "explain.json"
    assert main(["--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "bench_explain" and "bench_explain" in report["command"]
    assert report["machine"]["cpu"] and report["limit"] == LIMIT and report["extra_ig_steps"] == [1]
    labels = ["none", *EXPLAIN_METHODS, "integrated_gradients@1"]
    assert set(report["models"]) == {"release", "tiny"}
    for name, model in report["models"].items():
        assert model["model"]["random_weights"] and model["built_layers"] == 4
        assert model["extrapolated_to_layers"] == (8 if name == "release" else 4)
        assert model["ig_steps"] == 2 and model["repeats"] == 1 and model["state_tokens"] == 16
        assert set(model["cases"]) == set(CASES)
        for case_name, case in model["cases"].items():
            questions = len(CASES[case_name])
            assert case["questions"] == questions
            assert case["without"]["cache"] == ["miss"]  # every decision is a fresh state
            assert set(case["without"]["ms"]) == SPREAD_KEYS and case["without"]["ms"]["n"] == 1
            assert set(case["cached_state"]) == set(labels)
            assert all(entry["cache"] == ["hit"] for entry in case["cached_state"].values())
            for label in labels[1:]:
                figures = case[label]
                assert (
                    set(figures["ratio"]) == RATIO_KEYS and set(figures["extrapolated_ratio"]) == RATIO_KEYS
                )
                assert set(figures["ms"]) == SPREAD_KEYS and set(figures["explain_ms"]) == SPREAD_KEYS
                assert figures["evidence_items"] and all(
                    0 < n <= 5 * questions for n in figures["evidence_items"]
                )
    rows = report["table"]
    assert len(rows) == 2 * len(CASES) * (len(labels) - 1)
    assert {(row["model"], row["case"], row["method"]) for row in rows} == {
        (model, case, label) for model in ("release", "tiny") for case in CASES for label in labels[1:]
    }
    assert all(isinstance(row["within_limit"], bool) for row in rows)


def test_a_depth_that_transformers_cannot_build_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--layers", "3", "--json", "/dev/null"])
    assert exit_info.value.code == 2 and "--layers" in capsys.readouterr().err


def test_the_backbone_share_is_scaled_to_the_full_depth() -> None:
    assert extrapolated(10.0, 8.0, built_layers=4, full_layers=32) == pytest.approx(2.0 + 64.0)
    assert extrapolated(10.0, 8.0, built_layers=4, full_layers=4) == pytest.approx(10.0)


def test_ig_steps_are_put_back_even_after_an_error() -> None:
    saved = attribution.IG_STEPS
    with pytest.raises(RuntimeError), ig_steps(saved + 3):
        steps_inside = attribution.IG_STEPS
        raise RuntimeError("stop")
    assert (steps_inside, attribution.IG_STEPS) == (saved + 3, saved)
    with ig_steps(None):
        steps_untouched = attribution.IG_STEPS
    assert steps_untouched == saved
