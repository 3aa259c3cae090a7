"""The CPU weight modes and kernels chosen by ``Backbone.load``."""

from __future__ import annotations

import pytest
import torch

from clef_runtime.model.backbone import Backbone
from clef_runtime.model.kernels import kernels_installed
from clef_runtime.model.resolve import resolve_model

IDS = list(range(1000, 1300))


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    plain = Backbone.load(resolve_model("tiny").path, weights="fp32", cpu_kernels=False)
    assert not kernels_installed(plain.model)
    return plain.hidden_states(IDS)


def test_default_load_uses_the_cpu_kernels_and_matches_transformers(reference: torch.Tensor) -> None:
    loaded = Backbone.load(resolve_model("tiny").path)
    assert kernels_installed(loaded.model)
    assert (loaded.hidden_states(IDS) - reference).abs().max().item() <= 1e-4


def test_bf16_storage_halves_weights_and_keeps_fp32_compute(reference: torch.Tensor) -> None:
    loaded = Backbone.load(resolve_model("tiny").path, weights="bf16-storage")
    assert loaded.weight_mode == "bf16-storage"
    assert loaded.dtype == torch.float32
    assert loaded.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16
    hidden = loaded.hidden_states(IDS)
    assert hidden.dtype == torch.float32
    # The tiny checkpoint is stored in bf16, so bf16 storage loses nothing: only kernel rounding differs.
    assert (hidden - reference).abs().max().item() <= 1e-4


def test_auto_picks_bf16_storage_when_fp32_does_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    import clef_runtime.model.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 64 * 1024**3)
    assert Backbone.load(resolve_model("tiny").path).weight_mode == "fp32"
    # Little memory: fp32 weights do not fit with headroom, bf16 storage is chosen (and still fits).
    monkeypatch.setattr(memory, "available_memory", lambda device: 3 * 1024**3)
    monkeypatch.setattr(memory, "check_fits", lambda estimate, available=None: None)
    assert Backbone.load(resolve_model("tiny").path).weight_mode == "bf16-storage"


def test_unknown_weight_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="weights"):
        Backbone.load(resolve_model("tiny").path, weights="int4")
