"""The known releases' layouts without weights, and what the memory planner says about them: Clef-flash's
layout is the published release's exactly; the 27B Clef's does not fit a 24 GB machine in any weight mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clef_runtime.model.checkpoint import CheckpointInfo, verify_checkpoint
from clef_runtime.model.layouts import (
    CLEF_27B_GEOMETRY,
    RELEASE_GEOMETRIES,
    estimate_release_memory,
    layout_info,
    release_layout,
)
from clef_runtime.model.memory import InsufficientMemoryError, check_fits, estimate_model_memory
from clef_runtime.model.tiny import TINY_HEAD_CONFIG, tiny_config
from clef_runtime.options import OptionsError
from clef_runtime.release import LM_HEAD_TENSOR, TEXT_PREFIX, VISION_PREFIX

GB = 1e9
MACHINE_24_GB = 24_000_000_000


def _params(info: CheckpointInfo, prefix: str) -> int:
    return sum(t.numel for name, t in info.tensors.items() if name.startswith(prefix))


def test_a_layout_is_what_verify_checkpoint_reads_from_the_written_checkpoint(tiny_dir: Path) -> None:
    written = verify_checkpoint(tiny_dir)
    layout = layout_info(tiny_config(), TINY_HEAD_CONFIG)
    assert {n: (t.dtype, t.shape) for n, t in layout.tensors.items()} == {
        n: (t.dtype, t.shape) for n, t in written.tensors.items()
    }
    assert {n: t.shape for n, t in layout.head_tensors.items()} == {
        n: t.shape for n, t in written.head_tensors.items()
    }
    assert (layout.total_weight_bytes, layout.tensor_count) == (
        written.total_weight_bytes,
        written.tensor_count,
    )
    for dtype in (torch.float32, torch.bfloat16):
        assert estimate_model_memory(layout, device="cpu", dtype=dtype) == estimate_model_memory(
            written, device="cpu", dtype=dtype
        )


def test_the_clef_flash_layout_is_the_published_release() -> None:
    info = release_layout("Cloudflare/clef-flash")
    assert release_layout("CLOUDFLARE/Clef-Flash") is info  # built once
    # docs/model.md section 2: 760 tensors, 18,819,627,488 bytes; 8,953,803,264 text + 456,010,480 vision
    # parameters; the head 121,762,820 parameters in 122 tensors.
    assert (info.tensor_count, info.total_weight_bytes) == (760, 18_819_627_488)
    assert _params(info, TEXT_PREFIX) + info.tensors[LM_HEAD_TENSOR].numel == 8_953_803_264
    assert _params(info, VISION_PREFIX) == 456_010_480
    assert len(info.head_tensors) == 122
    assert sum(t.numel for t in info.head_tensors.values()) == 121_762_820
    # The figures of the int8 benchmark's memory section (BENCHMARKS.md, memory.py's docstring).
    for dtype, layers, total in (
        (torch.float32, None, 36.9),
        (torch.bfloat16, None, 20.3),
        (torch.bfloat16, "late", 15.7),
        (torch.bfloat16, "all", 13.0),
    ):
        estimate = estimate_release_memory("Cloudflare/clef-flash", dtype=dtype, int8_layers=layers)
        assert round(estimate.total_bytes / GB, 1) == total
        assert round(estimate.least_total_bytes / GB, 1) == 13.0


def test_the_27b_layout_has_the_qwen35_27b_geometry() -> None:
    info = release_layout("Cloudflare/clef")
    text = info.text_config
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (5120, 64, 248_320)
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert text["rope_parameters"]["mrope_section"] == [11, 11, 10]
    assert info.config["vision_config"]["out_hidden_size"] == 5120
    assert info.head_config["hidden_size"] == 5120
    shapes = {name.removeprefix(TEXT_PREFIX): t.shape for name, t in info.tensors.items()}
    # Gated attention: 24 query heads of 256 (and their gates), 4 KV heads; wider than the hidden size.
    assert shapes["layers.3.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)
    assert shapes["layers.3.self_attn.k_proj.weight"] == (4 * 256, 5120)
    assert shapes["layers.3.self_attn.o_proj.weight"] == (5120, 24 * 256)
    # Gated DeltaNet: 16 key heads and 48 value heads of 128.
    assert shapes["layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert shapes["layers.0.linear_attn.in_proj_z.weight"] == (48 * 128, 5120)
    assert shapes["layers.0.linear_attn.in_proj_a.weight"] == (48, 5120)
    assert shapes["layers.0.linear_attn.conv1d.weight"] == (2 * 16 * 128 + 48 * 128, 1, 4)
    assert shapes["layers.0.linear_attn.out_proj.weight"] == (5120, 48 * 128)
    assert shapes["layers.63.mlp.gate_proj.weight"] == (17_408, 5120)
    assert info.tensors[LM_HEAD_TENSOR].shape == (248_320, 5120)
    # 27.4 B parameters, 54.7 GB in bf16 (docs/clef-27b.md section 4).
    assert info.tensor_count == 1184
    assert round(info.total_weight_bytes / GB, 1) == 54.7
    assert round(_params(info, TEXT_PREFIX) / 1e9, 2) == 25.62


@pytest.mark.parametrize(
    ("dtype", "layers", "total_gb"),
    [
        (torch.float32, None, 111.8),  # --weights fp32: the CPU default compute
        (torch.bfloat16, None, 57.9),  # --weights bf16-storage (or bf16 compute)
        (torch.float32, "late", 63.8),  # --weights int8, layers 24-63, fp32 elsewhere
        (torch.bfloat16, "late", 42.0),  # --weights int8, layers 24-63, bf16 elsewhere
        (torch.bfloat16, "all", 32.4),  # --weights int8 --int8-layers all: the least
    ],
)
def test_the_27b_does_not_fit_a_24_gb_machine_and_the_planner_says_what_it_needs(
    dtype: torch.dtype, layers: str | None, total_gb: float
) -> None:
    estimate = estimate_release_memory("Cloudflare/clef", dtype=dtype, int8_layers=layers)
    assert round(estimate.total_bytes / GB, 1) == total_gb
    assert round(estimate.least_total_bytes / GB, 1) == 32.4
    if layers is not None:
        assert estimate.int8_layers == ((tuple(range(24, 64))) if layers == "late" else tuple(range(64)))
    with pytest.raises(InsufficientMemoryError) as error:
        check_fits(estimate, available=MACHINE_24_GB)
    assert (error.value.needed_bytes, error.value.available_bytes) == (estimate.total_bytes, MACHINE_24_GB)
    message = str(error.value)
    assert f"needs ~{total_gb:.1f} GB" in message and "only 24.0 GB is available" in message
    # No advice to try a mode that would not fit either: the least figure instead.
    assert "no weight mode fits" in message and "--int8-layers all" in message and "~32.4 GB" in message
    assert "--device cuda" in message
    assert "bf16-storage (half the memory" not in message
    # It does fit a machine with room for the estimate.
    check_fits(estimate, available=estimate.total_bytes)


def test_the_27b_with_its_vision_tower_and_the_clef_flash_advice() -> None:
    text_only = estimate_release_memory("Cloudflare/clef", dtype=torch.bfloat16)
    with_vision = estimate_release_memory("Cloudflare/clef", dtype=torch.bfloat16, include_vision=True)
    # The stock 27-block tower at width 5,120: 460,730,096 parameters, ~0.9 GB in bf16 (+ working memory).
    assert with_vision.vision_bytes == 460_730_096 * 2
    assert with_vision.total_bytes > text_only.total_bytes
    # Clef-flash on 24 GB: bf16 storage or int8 would fit, so that is what the refusal of fp32 advises.
    flash = estimate_release_memory("Cloudflare/clef-flash", dtype=torch.float32)
    with pytest.raises(InsufficientMemoryError) as error:
        check_fits(flash, available=MACHINE_24_GB)
    assert "--weights bf16-storage" in str(error.value) and "no weight mode fits" not in str(error.value)


def test_the_27b_geometry_table_and_bad_arguments() -> None:
    assert RELEASE_GEOMETRIES["cloudflare/clef"] is CLEF_27B_GEOMETRY
    with pytest.raises(KeyError, match="no known release"):
        release_layout("Org/other-model")
    with pytest.raises(OptionsError, match="--int8-layers"):
        estimate_release_memory("Cloudflare/clef", int8_layers="64")
