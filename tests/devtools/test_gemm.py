"""`devtools.gemm`: the rates from the timings, limits over the shapes asked for, and the shapes a
model runs."""

from __future__ import annotations

from typing import Any

import pytest
from devtools.gemm import DTYPES, GemmShape, gemm_limit, linear_shapes, measure_gemm, model_shapes
from devtools.timing import Samples
from torch import nn

from devtools import gemm

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


# Seconds per timed call, by (shape, dtype); the rates they make are worked out by hand in the test.
A, B, C = GemmShape(100, 200, 300), GemmShape(100, 200, 600), GemmShape(50, 200, 300)
SECONDS: dict[tuple[GemmShape, str], list[float]] = {
    (A, "fp32"): [0.004, 0.003, 0.006],  # 12 MFLOP: 3, 4, 2 GFLOP/s
    (B, "fp32"): [0.002, 0.003, 0.004],  # 24 MFLOP: 12, 8, 6
    (C, "fp32"): [0.0003, 0.0006, 0.001],  # 6 MFLOP: 20, 10, 6
    (A, "int8"): [0.001, 0.002, 0.003],  # 12 MOP: 12, 6, 4 GOP/s
}


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`measure_gemm` with the timings of `SECONDS` instead of real GEMMs (a pair not listed fails the way
    a kernel a device lacks does)."""

    def operands(shape: GemmShape, dtype: str, device: Any) -> tuple[GemmShape, str]:
        return shape, dtype

    def repeat(call: tuple[GemmShape, str], repeats: int, sync: Any = None) -> Samples:
        if call not in SECONDS:
            raise RuntimeError("no kernel for this shape\nsecond line")
        return Samples.of(SECONDS[call])

    monkeypatch.setattr(gemm, "_operands", operands)
    monkeypatch.setattr(gemm, "repeat", repeat)


def test_rates_are_operations_over_seconds_and_the_best_is_the_fastest_call(timed: None) -> None:
    record = measure_gemm((A, B, C), dtypes=("fp32", "int8"), repeats=3)
    rows = {(row["tokens"], row["inner"], row["outer"]): row for row in record["shapes"]}
    assert rows[(100, 200, 300)]["fp32_gflops"] == {"best": 4.0, "median": 3.0, "samples": [3.0, 4.0, 2.0]}
    assert rows[(100, 200, 600)]["fp32_gflops"] == {"best": 12.0, "median": 8.0, "samples": [12.0, 8.0, 6.0]}
    assert rows[(50, 200, 300)]["fp32_gflops"] == {"best": 20.0, "median": 10.0, "samples": [20.0, 10.0, 6.0]}
    assert rows[(100, 200, 300)]["int8_gops"] == {"best": 12.0, "median": 6.0, "samples": [12.0, 6.0, 4.0]}
    # A dtype a shape cannot run: its first line is kept, and no rate is made up.
    assert rows[(100, 200, 600)]["int8_gops"] == {"error": "no kernel for this shape"}
    assert rows[(100, 200, 300)]["shape"] == "[100x200] @ [200x300]"
    # The limit of a dtype: its best rate over every shape measured.
    assert record["limit"] == {"fp32_gflops": 20.0, "int8_gops": 12.0}


def test_the_limit_at_a_length_is_the_best_over_the_model_shapes_at_that_length(timed: None) -> None:
    record = measure_gemm((A, B, C), dtypes=("fp32", "int8"), repeats=3)
    model = nn.Sequential(nn.Linear(200, 300), nn.Linear(200, 600))
    # T = 100: the best of A (4) and B (12); C's 20 GFLOP/s is at another length.
    assert gemm_limit(record, "fp32", model_shapes(model, [100])) == 12.0
    # T = 50: only (200 -> 300) was measured there.
    assert gemm_limit(record, "fp32", model_shapes(model, [50])) == 20.0
    assert gemm_limit(record, "int8", model_shapes(model, [100])) == 12.0
    with pytest.raises(KeyError):
        gemm_limit(record, "int8", model_shapes(model, [50]))
