"""The compute-dtype benchmark's own arithmetic: the 9B projection and the generated drift cases."""

from __future__ import annotations

import pytest

from tests.benchmarks import load_benchmark

bench = load_benchmark("bench_dtype")


def _mode(request_s: float, backbone_s: float, tokens: int = 1000) -> dict[str, object]:
    return {"tokens": tokens, "request_s": {"median": request_s}, "backbone_s": {"median": backbone_s}}


def test_the_projection_scales_the_backbone_to_32_layers_and_mixes_int8_late() -> None:
    modes = {"fp32": _mode(4.5, 4.0), "bf16": _mode(2.5, 2.0), "int8-all": _mode(1.5, 1.0)}
    projection = bench.project(modes, block_layers=4)
    # fp32: 0.5 s outside the backbone + 32 layers x 1 s; int8 late: 0.5 + 12 x 1 s + 20 x 0.25 s.
    assert projection["tokens_per_s"]["fp32"] == pytest.approx(1000 / 32.5, abs=0.01)
    assert projection["tokens_per_s"]["bf16"] == pytest.approx(1000 / 16.5, abs=0.01)
    assert projection["tokens_per_s"]["int8-late"] == pytest.approx(1000 / 17.5, abs=0.01)
    assert projection["vs_fp32"]["int8-all"] == pytest.approx(32.5 / 8.5, abs=0.01)


def test_drift_cases_span_short_to_long_states_and_carry_images() -> None:
    cases = bench.drift_cases(6, 2)
    texts = [case for case in cases if case["id"].startswith("text-")]
    images = [case for case in cases if case["id"].startswith("image-")]
    assert len(texts) == 6 and len(images) == 2
    lengths = [len(case["state"].split()) for case in texts]
    assert lengths == sorted(lengths) and lengths[0] < 100 and lengths[-1] > 1400
    assert all(len(case["images"]) == 2 and case["images"][0].startswith("data:image/png") for case in images)
    assert bench.drift_cases(6, 2) == cases  # deterministic: the same cases every run
