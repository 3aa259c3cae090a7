"""`benchmarks.lib.gemm`: limits over the shapes asked for, and the shapes a model runs."""

from __future__ import annotations

import pytest
from benchmarks.lib.gemm import DTYPES, GemmShape, gemm_limit, linear_shapes, measure_gemm, model_shapes
from torch import nn

SHAPES = (GemmShape(32, 64, 64), GemmShape(32, 64, 128))


def test_a_limit_over_some_shapes_only_looks_at_those() -> None:
    record = measure_gemm(SHAPES, dtypes=("fp32",), repeats=1)
    first = record["shapes"][0]["fp32_gflops"]["best"]
    assert gemm_limit(record, "fp32", [SHAPES[0]]) == first
    assert gemm_limit(record, "fp32") >= first
    with pytest.raises(KeyError):
        gemm_limit(record, "int8")  # not measured
    with pytest.raises(KeyError):
        gemm_limit(record, "fp32", [GemmShape(1, 2, 3)])
    with pytest.raises(ValueError):
        measure_gemm(SHAPES, dtypes=("fp16",))
    assert DTYPES == ("fp32", "bf16", "int8")


def test_model_shapes_are_the_distinct_linear_sizes_at_each_length() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 16))
    assert linear_shapes(model) == [(8, 16), (16, 8)]
    assert model_shapes(model, [4, 32]) == [
        GemmShape(4, 8, 16),
        GemmShape(4, 16, 8),
        GemmShape(32, 8, 16),
        GemmShape(32, 16, 8),
    ]
    assert GemmShape(4, 8, 16).operations == 2 * 4 * 8 * 16
