"""The fused-kernel switch: transformers' Qwen3.5 DeltaNet functions swapped to the reference and back."""

from __future__ import annotations

import inspect

from clef_runtime.model.fused import FUSED_FUNCTIONS, fused_kernels_status, set_fused_kernels


def test_switch_swaps_to_the_reference_functions_and_back() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    before = {name: getattr(module, name) for name in FUSED_FUNCTIONS}
    try:
        set_fused_kernels(False)
        for name in FUSED_FUNCTIONS:
            current = getattr(module, name)
            assert current is inspect.unwrap(before[name])
            assert not hasattr(current, "__wrapped__")  # the reference function itself, no dispatcher
        assert not any(fused_kernels_status()["active"].values())
        set_fused_kernels(False)  # twice is harmless
        set_fused_kernels(True)
        assert {name: getattr(module, name) for name in FUSED_FUNCTIONS} == before
    finally:
        set_fused_kernels(True)
    status = fused_kernels_status()
    assert set(status["packages"]) == {"flash-linear-attention", "causal-conv1d"}
    assert set(status["active"]) == set(FUSED_FUNCTIONS)
