"""`devtools.machine`: the machine record, with its GEMM limits measured on tiny shapes."""

from __future__ import annotations

import torch
from devtools.gemm import GemmShape
from devtools.machine import ISA_FLAGS, machine_record

SHAPES = (GemmShape(32, 64, 64), GemmShape(32, 64, 128))


def test_the_record_names_the_machine_and_measures_positive_limits() -> None:
    record = machine_record(gemm_shapes=SHAPES, gemm_repeats=3)
    for key in ("cpu", "cpu_count", "cpu_affinity", "memory_gib", "platform", "python", "device", "gpu"):
        assert key in record
    assert record["cpu"] and record["cpu_count"] >= 1
    assert set(record["cpu_flags"]) == set(ISA_FLAGS)
    assert record["torch"]["version"] == torch.__version__
    assert record["torch"]["threads"] == torch.get_num_threads() >= 1
    assert {"cuda", "mkl", "onednn", "cpu_capability"} <= set(record["torch"])
    gemm = record["gemm"]
    assert gemm["repeats"] == 3 and len(gemm["shapes"]) == len(SHAPES)
    for row in gemm["shapes"]:
        for key in ("fp32_gflops", "bf16_gflops", "int8_gops"):
            assert len(row[key]["samples"]) == 3
            assert row[key]["best"] == max(row[key]["samples"]) > 0
    # The limit of each dtype is the best rate over the shapes.
    assert gemm["limit"]["fp32_gflops"] == max(row["fp32_gflops"]["best"] for row in gemm["shapes"])
    assert set(gemm["limit"]) == {"fp32_gflops", "bf16_gflops", "int8_gops"}
