"""preprocess: fixed tiles against an independent patchify and against transformers' processor; native mode
against the processor itself, with and without the token cap."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from clef_runtime.vision.preprocess import (
    DEFAULT_IMAGE_PROCESSOR_CONFIG,
    PreprocessedImage,
    patchify,
    preprocess,
)
from tests.vision.helpers import photo_like

STOCK_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "resample": 3,
}


def smart_resize(height: int, width: int, *, min_pixels: int = 65_536, max_pixels: int = 16_777_216):
    """transformers' resize rule with the stock Qwen3.5 bounds (32 px per merged token side)."""
    return hf_smart_resize(height, width, factor=32, min_pixels=min_pixels, max_pixels=max_pixels)


def reference_processor(**size) -> Qwen2VLImageProcessorPil:
    config = dict(STOCK_CONFIG)
    if size:
        config["size"] = size
    return Qwen2VLImageProcessorPil(**config)


def run_reference(image: Image.Image, processor: Qwen2VLImageProcessorPil) -> tuple[torch.Tensor, tuple]:
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def seed_patchify(normalised_hwc: np.ndarray) -> np.ndarray:
    """The seed's description, written out with loops: rows (block_row, block_col, y_in_block, x_in_block),
    each row the (C, T=2, 16, 16) vector, the still frame at both temporal slots."""
    height, width, _ = normalised_hwc.shape
    rows = []
    for block_row in range(height // 32):
        for block_col in range(width // 32):
            for y_in_block in range(2):
                for x_in_block in range(2):
                    top = block_row * 32 + y_in_block * 16
                    left = block_col * 32 + x_in_block * 16
                    patch = normalised_hwc[top : top + 16, left : left + 16, :]  # (16, 16, C)
                    vector = np.empty((3, 2, 16, 16), dtype=np.float32)
                    for channel in range(3):
                        for t in range(2):
                            vector[channel, t] = patch[:, :, channel]
                    rows.append(vector.reshape(-1))
    return np.stack(rows)


def seed_normalise(rgb: np.ndarray) -> np.ndarray:
    return ((rgb.astype(np.float32) / np.float32(255)) - np.float32(0.5)) / np.float32(0.5)


# --- fixed tiles ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "tile", "merged"), [("g256", 256, 8), ("g448", 448, 14)])
def test_tile_modes_have_the_seed_token_counts(mode, tile, merged):
    result = preprocess(photo_like(300, 200), mode)
    assert isinstance(result, PreprocessedImage)
    assert result.merged_hw == (merged, merged)
    assert result.n_tokens == merged * merged  # 64 / 196
    assert result.grid_thw == (1, 2 * merged, 2 * merged)
    assert tuple(result.pixel_values.shape) == (4 * merged * merged, 1536)  # 256 / 784 patches
    assert result.pixel_values.dtype == torch.float32


def test_patchify_matches_the_seed_description():
    rng = np.random.default_rng(3)
    image = rng.uniform(-1, 1, (64, 96, 3)).astype(np.float32)
    ours = patchify(image)
    assert tuple(ours.shape) == (24, 1536)
    assert np.array_equal(ours.numpy(), seed_patchify(image))


def test_patchify_rejects_shapes_that_are_not_whole_blocks():
    with pytest.raises(ValueError):
        patchify(np.zeros((48, 64, 3), dtype=np.float32))


@pytest.mark.parametrize(("mode", "tile"), [("g256", 256), ("g448", 448)])
def test_tile_path_matches_the_seed_pipeline_on_any_image(mode, tile):
    image = photo_like(333, 201, seed=5)
    expected_rgb = np.asarray(image.resize((tile, tile), Image.Resampling.BICUBIC))
    expected = seed_patchify(seed_normalise(expected_rgb))
    ours = preprocess(image, mode).pixel_values.numpy()
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)
    # The filter matters: bilinear gives different pixels on this image.
    bilinear = seed_patchify(
        seed_normalise(np.asarray(image.resize((tile, tile), Image.Resampling.BILINEAR)))
    )
    assert not np.allclose(ours, bilinear, atol=1e-3)


@pytest.mark.parametrize(("mode", "tile"), [("g256", 256), ("g448", 448)])
def test_tile_path_equals_the_processor_on_an_image_of_the_tile_size(mode, tile):
    image = photo_like(tile, tile, seed=tile)
    reference, grid = run_reference(image, reference_processor())
    ours = preprocess(image, mode)
    assert grid == ours.grid_thw
    assert torch.equal(ours.pixel_values, reference)


# --- native ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(300, 200), (640, 480), (1001, 333), (50, 20)])
def test_native_equals_the_reference_processor(size):
    image = photo_like(*size, seed=sum(size))
    reference, grid = run_reference(image, reference_processor())
    ours = preprocess(image, "native", max_tokens=None)
    assert ours.grid_thw == grid
    assert torch.equal(ours.pixel_values, reference)
    height, width = smart_resize(size[1], size[0])
    assert ours.merged_hw == (height // 32, width // 32)
    assert ours.n_tokens == (height // 32) * (width // 32)


def test_native_accepts_the_checkpoint_processor_config_in_both_layouts():
    image = photo_like(120, 90)
    expected = preprocess(image, "native")
    nested = {"image_processor": {**STOCK_CONFIG, "image_processor_type": "Qwen2VLImageProcessorFast"}}
    flat = {**STOCK_CONFIG, "processor_class": "Qwen3VLProcessor"}
    for config in (nested, flat, DEFAULT_IMAGE_PROCESSOR_CONFIG):
        got = preprocess(image, "native", processor_config=config)
        assert got.grid_thw == expected.grid_thw
        assert torch.equal(got.pixel_values, expected.pixel_values)


def test_native_uses_the_configured_pixel_bounds():
    image = photo_like(640, 480)
    small = {**STOCK_CONFIG, "size": {"shortest_edge": 1024, "longest_edge": 64 * 32 * 32}}
    got = preprocess(image, "native", max_tokens=None, processor_config=small)
    assert got.n_tokens <= 64
    reference, grid = run_reference(image, reference_processor(shortest_edge=1024, longest_edge=64 * 32 * 32))
    assert got.grid_thw == grid and torch.equal(got.pixel_values, reference)


def test_native_cap_scales_down_keeping_the_aspect():
    image = photo_like(2000, 1500, seed=9)
    uncapped_h, uncapped_w = smart_resize(1500, 2000)
    assert (uncapped_h // 32) * (uncapped_w // 32) > 1024
    capped = preprocess(image, "native", max_tokens=1024)
    # Documented rule: max pixels lowered to 1024 * 32 * 32, smart_resize floors both sides.
    assert capped.merged_hw == (27, 36)  # floor(1500/1.6915/32), floor(2000/1.6915/32)
    assert capped.n_tokens == 972 <= 1024
    reference, grid = run_reference(
        image, reference_processor(shortest_edge=65536, longest_edge=1024 * 32 * 32)
    )
    assert capped.grid_thw == grid and torch.equal(capped.pixel_values, reference)


def test_native_cap_does_not_touch_images_within_it():
    image = photo_like(1024, 768)
    capped = preprocess(image, "native")
    uncapped = preprocess(image, "native", max_tokens=None)
    assert capped.n_tokens == uncapped.n_tokens == 24 * 32
    assert torch.equal(capped.pixel_values, uncapped.pixel_values)


@pytest.mark.parametrize("size", [(4000, 3000), (6400, 32), (32, 6400), (4000, 4000), (3000, 401)])
@pytest.mark.parametrize("cap", [200, 256, 1024, 4096])
def test_native_cap_always_holds(size, cap):
    height, width = size[1], size[0]
    rounded = smart_resize(height, width, max_pixels=16_777_216)
    target = smart_resize(height, width, max_pixels=cap * 1024, min_pixels=min(65_536, cap * 1024))
    tokens = (target[0] // 32) * (target[1] // 32)
    assert tokens <= cap
    if (rounded[0] // 32) * (rounded[1] // 32) <= cap:
        assert target == rounded
