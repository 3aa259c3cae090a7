"""Image -> vision-tower input (``pixel_values`` [N_patch, 1536] + ``grid_thw``), in three modes.

``native`` (the reference)
    transformers' Qwen2-VL image processor, which is what Qwen3.5's ``AutoImageProcessor`` resolves to in
    transformers 5.24 (``qwen3_5`` -> ``Qwen2VLImageProcessor`` with torchvision, ``Qwen2VLImageProcessorPil``
    without). We construct the **PIL** class (no torchvision here; the release's config names the torchvision
    "Fast" class, whose bicubic resize of a tensor is not bit-identical to Pillow's) from the checkpoint's
    ``processor_config.json`` dict (nested ``{"image_processor": {...}}`` or flat; defaults:
    :data:`DEFAULT_IMAGE_PROCESSOR_CONFIG`, the stock Qwen3.5 values). It does ``smart_resize`` to multiples
    of 32 within [shortest_edge, longest_edge] pixels (65,536 .. 16,777,216), aspect kept, Pillow BICUBIC,
    x/255, (x - 0.5)/0.5, the frame at both temporal slots, merge-block-major patchify.

    Token cap (``max_tokens``, default 1,024 merged tokens, like the hosted service): the processor's
    ``longest_edge`` (max pixels) is lowered to ``max_tokens * 32 * 32`` (1,048,576 px for 1,024 tokens, the
    hosted "about 1 megapixel"). ``smart_resize`` then either keeps its rounded size (already within the
    budget) or rescales both sides by ``sqrt(h * w / max_pixels)`` and rounds each side **down** to a
    multiple of 32 (aspect kept), so ``H * W <= max_tokens``; images within the budget are processed exactly
    as without a cap. ``max_tokens=None`` gives the uncapped reference. ``max_tokens`` must be at least 200
    (with aspect ratios up to 200:1 this is what guarantees that flooring never falls under one 32-px
    block per side).

``g256`` / ``g448`` (the seed's fixed tiles, CoreAI port)
    Pillow BICUBIC resize of the RGB image to 256x256 / 448x448 (aspect **not** kept), x/255, (x - 0.5)/0.5,
    merge-block-major patchify: merged grids 8x8 = 64 and 14x14 = 196 tokens. Implemented here with
    numpy/torch (same float steps as the processor, so an image already at the tile size gives bit-identical
    ``pixel_values``).

Patch order ("merge-block-major"): rows are ordered (block_row, block_col, y_in_block, x_in_block) where a
block is the 2x2 group of 16-px patches that the merger folds into one token; each row is the vector
(C=3, T=2, 16, 16) flattened, with the still frame at both temporal slots.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from clef_runtime.options import DEFAULT_IMAGE_MAX_TOKENS

__all__ = [
    "DEFAULT_IMAGE_PROCESSOR_CONFIG",
    "DEFAULT_MAX_TOKENS",
    "MIN_MAX_TOKENS",
    "MODES",
    "PATCH_DIM",
    "TILE_SIZES",
    "PreprocessedImage",
    "patchify",
    "preprocess",
]

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
CHANNELS = 3
FACTOR = PATCH_SIZE * MERGE_SIZE  # 32 px per merged token side
PATCH_DIM = CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1536

DEFAULT_MAX_TOKENS = DEFAULT_IMAGE_MAX_TOKENS
"""Default cap of merged tokens per image in ``native`` mode (the hosted service's cap)."""
MIN_MAX_TOKENS = 200
"""Smallest accepted ``max_tokens`` (see the module docstring)."""
TILE_SIZES = {"g256": 256, "g448": 448}
MODES = ("native", "g256", "g448")

DEFAULT_IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": MERGE_SIZE,
    "patch_size": PATCH_SIZE,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 16_777_216, "shortest_edge": 65_536},
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
}
"""The stock Qwen3.5 image-processor settings (the release ships the stock ``processor_config.json``)."""

# Keys of a processor config that configure the image transform; everything else (processor_class,
# image_processor_type, video keys, ...) is ignored.
_PROCESSOR_KEYS = frozenset(
    {
        "do_convert_rgb",
        "do_normalize",
        "do_rescale",
        "do_resize",
        "image_mean",
        "image_std",
        "merge_size",
        "patch_size",
        "resample",
        "rescale_factor",
        "size",
        "temporal_patch_size",
        "min_pixels",
        "max_pixels",
    }
)


@dataclass(frozen=True)
class PreprocessedImage:
    """Vision-tower input for one image.

    ``pixel_values``: fp32 [N_patch, 1536] in merge-block-major order; ``grid_thw``: (1, gh, gw) in 16-px
    patches; ``merged_hw``: (H, W) = (gh/2, gw/2), the token grid; ``n_tokens`` = H * W image-pad tokens.
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    merged_hw: tuple[int, int]
    n_tokens: int


def _image_processor_dict(processor_config: Mapping[str, Any] | None) -> dict[str, Any]:
    if processor_config is None:
        return dict(DEFAULT_IMAGE_PROCESSOR_CONFIG)
    section = processor_config.get("image_processor", processor_config)
    if not isinstance(section, Mapping):
        raise ValueError("processor_config['image_processor'] must be an object")
    return {k: v for k, v in section.items() if k in _PROCESSOR_KEYS}


@functools.lru_cache(maxsize=8)
def _processor_from_json(config_json: str) -> Any:
    # Imported lazily: transformers' image stack is slow to import and only native mode needs it.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**json.loads(config_json))


def _capped_config(config: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    if (
        config.get("patch_size", PATCH_SIZE) != PATCH_SIZE
        or config.get("merge_size", MERGE_SIZE) != MERGE_SIZE
    ):
        raise ValueError("only patch_size 16 and merge_size 2 are supported (the Qwen3.5 vision tower)")
    if config.get("temporal_patch_size", TEMPORAL_PATCH_SIZE) != TEMPORAL_PATCH_SIZE:
        raise ValueError("only temporal_patch_size 2 is supported")
    config = dict(config)
    size = dict(config.get("size") or DEFAULT_IMAGE_PROCESSOR_CONFIG["size"])
    # Old-style keys win, as in the processor's own constructor.
    if "min_pixels" in config:
        size["shortest_edge"] = config.pop("min_pixels")
    if "max_pixels" in config:
        size["longest_edge"] = config.pop("max_pixels")
    if max_tokens is not None:
        size["longest_edge"] = min(int(size["longest_edge"]), max_tokens * FACTOR * FACTOR)
        size["shortest_edge"] = min(int(size["shortest_edge"]), size["longest_edge"])
    config["size"] = size
    return config


def patchify(image_hwc: np.ndarray) -> torch.Tensor:
    """Merge-block-major patchify of a normalised float32 [h, w, 3] image (h, w multiples of 32).

    Returns fp32 [(h/16)*(w/16), 1536]: rows (block_row, block_col, y_in_block, x_in_block), each row the
    (C, T=2, 16, 16) vector with the frame at both temporal slots.
    """
    height, width, channels = image_hwc.shape
    if channels != CHANNELS or height % FACTOR or width % FACTOR:
        raise ValueError(f"patchify needs [h, w, 3] with h, w multiples of {FACTOR}, got {image_hwc.shape}")
    blocks_h, blocks_w = height // FACTOR, width // FACTOR
    chw = torch.from_numpy(np.ascontiguousarray(image_hwc, dtype=np.float32)).permute(2, 0, 1)
    # (C, block_row, y_in_block, py, block_col, x_in_block, px)
    grid = chw.reshape(CHANNELS, blocks_h, MERGE_SIZE, PATCH_SIZE, blocks_w, MERGE_SIZE, PATCH_SIZE)
    # -> (block_row, block_col, y_in_block, x_in_block, C, py, px)
    grid = grid.permute(1, 4, 2, 5, 0, 3, 6)
    # still frame: the same pixels at both temporal slots -> (..., C, T, py, px)
    grid = grid.unsqueeze(5).expand(*grid.shape[:5], TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE)
    n_patches = (height // PATCH_SIZE) * (width // PATCH_SIZE)
    return grid.reshape(n_patches, PATCH_DIM).contiguous()


def _normalise(rgb_uint8: np.ndarray) -> np.ndarray:
    # Same float steps as transformers' rescale (in float64, then float32) and normalize (float32), so the
    # fixed-tile path is bit-identical to the processor on the same pixels.
    scaled = (rgb_uint8.astype(np.float64) * (1 / 255)).astype(np.float32)
    half = np.float32(0.5)
    return (scaled - half) / half


def _result(pixel_values: torch.Tensor, grid_h: int, grid_w: int) -> PreprocessedImage:
    merged = (grid_h // MERGE_SIZE, grid_w // MERGE_SIZE)
    return PreprocessedImage(
        pixel_values=pixel_values,
        grid_thw=(1, grid_h, grid_w),
        merged_hw=merged,
        n_tokens=merged[0] * merged[1],
    )


def _preprocess_tile(image: Image.Image, tile: int) -> PreprocessedImage:
    resized = image.resize((tile, tile), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(resized, dtype=np.uint8)
    values = patchify(_normalise(pixels))
    return _result(values, tile // PATCH_SIZE, tile // PATCH_SIZE)


def _preprocess_native(
    image: Image.Image, max_tokens: int | None, processor_config: Mapping[str, Any] | None
) -> PreprocessedImage:
    config = _capped_config(_image_processor_dict(processor_config), max_tokens)
    processor = _processor_from_json(json.dumps(config, sort_keys=True))
    out = processor(images=[image], return_tensors="pt")
    pixel_values = out["pixel_values"].to(torch.float32).contiguous()
    _, grid_h, grid_w = (int(v) for v in out["image_grid_thw"][0].tolist())
    result = _result(pixel_values, grid_h, grid_w)
    if pixel_values.shape != (grid_h * grid_w, PATCH_DIM):
        raise RuntimeError(
            f"unexpected processor output {tuple(pixel_values.shape)} for grid {grid_h}x{grid_w}"
        )
    if max_tokens is not None and result.n_tokens > max_tokens:  # impossible for max_tokens >= 200
        raise RuntimeError(f"native preprocessing gave {result.n_tokens} tokens over the cap {max_tokens}")
    return result


def preprocess(
    image: Image.Image,
    mode: str,
    *,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    processor_config: Mapping[str, Any] | None = None,
) -> PreprocessedImage:
    """Turn an RGB image into vision-tower input.

    ``mode``: ``"native"`` (the reference processor, capped at ``max_tokens`` merged tokens; ``None`` = no
    cap), ``"g256"`` or ``"g448"`` (fixed tiles; ``max_tokens`` and ``processor_config`` are ignored).
    ``processor_config``: the checkpoint's ``processor_config.json`` (or ``preprocessor_config.json``) dict;
    ``None`` uses :data:`DEFAULT_IMAGE_PROCESSOR_CONFIG`.

    Returns a :class:`PreprocessedImage`. Raises ``ValueError`` for an unknown mode, a non-RGB image, a
    ``max_tokens`` under :data:`MIN_MAX_TOKENS`, or a processor config with another patch geometry.
    """
    if not isinstance(image, Image.Image) or image.mode != "RGB":
        raise ValueError("preprocess needs an RGB PIL image (use vision.decode.decode_image)")
    if mode in TILE_SIZES:
        return _preprocess_tile(image, TILE_SIZES[mode])
    if mode != "native":
        raise ValueError(f"unknown image mode {mode!r}; expected one of {', '.join(MODES)}")
    if max_tokens is not None and max_tokens < MIN_MAX_TOKENS:
        raise ValueError(f"max_tokens must be at least {MIN_MAX_TOKENS} (or None), got {max_tokens}")
    return _preprocess_native(image, max_tokens, processor_config)
