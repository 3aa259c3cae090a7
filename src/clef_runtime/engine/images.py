"""The engine's image preparation: request images -> vision-tower input, digests, positions and tower rows.

Per request (on the encode thread, no model lock): `prepare_images` decodes each `ImageSource` safely
(`clef_runtime.vision.decode.decode_image`), preprocesses it in the configured mode
(`clef_runtime.vision.preprocess.preprocess`: ``native`` capped at ``max_tokens``, ``g256`` or ``g448``) and
digests its pixels (`clef_runtime.engine.state_cache.image_digest`, part of the state-cache key).

Per batch (under the model lock): `ImageEmbedder` runs the lazily loaded vision tower on the images of the
rows that really need them (a state-cache hit does not), and `row_positions` gives the M-RoPE planes of a row
(transformers' ``get_rope_index`` rule, `clef_runtime.vision.positions.mrope_positions`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clef_runtime.encoding.encoder import EncodedRecord
from clef_runtime.engine.state_cache import image_digest
from clef_runtime.model.backbone import TRANSFORMERS_CONSTRUCTION_LOCK
from clef_runtime.protocol.images import ImageSource
from clef_runtime.vision.decode import decode_image
from clef_runtime.vision.positions import mrope_positions
from clef_runtime.vision.preprocess import (
    DEFAULT_MAX_TOKENS,
    MIN_MAX_TOKENS,
    MODES,
    PreprocessedImage,
    preprocess,
)
from clef_runtime.vision.tower import VisionTower

__all__ = [
    "IMAGE_MODES",
    "ImageEmbedder",
    "ImageSettings",
    "PreparedImage",
    "load_processor_config",
    "prepare_images",
    "row_positions",
]

IMAGE_MODES = MODES
"""``native`` (the reference processor, capped), ``g256`` and ``g448`` (the seed's fixed tiles)."""

_PROCESSOR_CONFIG_FILES = ("processor_config.json", "preprocessor_config.json")


@dataclass(frozen=True)
class ImageSettings:
    """How request images are turned into tower input: ``mode`` (one of `IMAGE_MODES`), ``max_tokens``
    (cap of merged tokens per image in ``native`` mode; None = the uncapped reference) and the checkpoint's
    ``processor_config`` (None = the stock Qwen3.5 settings)."""

    mode: str = "native"
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    processor_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.mode not in IMAGE_MODES:
            raise ValueError(f"unknown image mode {self.mode!r}; expected one of {', '.join(IMAGE_MODES)}")
        if self.max_tokens is not None and self.max_tokens < MIN_MAX_TOKENS:
            raise ValueError(
                f"image max_tokens must be at least {MIN_MAX_TOKENS} (or None), got {self.max_tokens}"
            )


@dataclass(frozen=True, eq=False)
class PreparedImage:
    """One request image ready for the tower: its `PreprocessedImage` and a 32-byte digest of its pixels."""

    pixels: PreprocessedImage
    digest: bytes
    size: tuple[int, int] = (0, 0)
    """The decoded image's (width, height) in pixels, what evidence boxes are given in; (0, 0): unknown, the
    tower's view (`pixel_size`) stands in."""

    @property
    def pixel_size(self) -> tuple[int, int]:
        """(width, height) for evidence boxes: the decoded image's, else the tower's 16-pixel patch grid's."""
        if self.size != (0, 0):
            return self.size
        _, grid_height, grid_width = self.pixels.grid_thw
        return (grid_width * 16, grid_height * 16)

    @property
    def n_tokens(self) -> int:
        """Its number of ``<|image_pad|>`` tokens (the merged grid H * W)."""
        return self.pixels.n_tokens


def load_processor_config(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint's ``processor_config.json`` (or ``preprocessor_config.json``) as a dict, or None when
    it has neither. Raises ValueError when the file is not a JSON object."""
    for name in _PROCESSOR_CONFIG_FILES:
        path = Path(checkpoint_dir) / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(value, dict):
                raise ValueError(f"{path}: expected a JSON object")
            return value
    return None


def prepare_images(sources: Sequence[ImageSource], settings: ImageSettings) -> tuple[PreparedImage, ...]:
    """Decode, preprocess and digest every image of a request, in order.

    Returns one `PreparedImage` per source. Raises `RequestValidationError` (naming the image's ``loc``)
    for an image that cannot be decoded or breaks a pixel limit.
    """
    prepared = []
    for source in sources:
        image = decode_image(source)
        pixels = preprocess(
            image, settings.mode, max_tokens=settings.max_tokens, processor_config=settings.processor_config
        )
        prepared.append(
            PreparedImage(
                pixels=pixels, digest=image_digest(pixels.pixel_values, pixels.grid_thw), size=image.size
            )
        )
    return tuple(prepared)


def check_images(record: EncodedRecord, images: Sequence[PreparedImage]) -> None:
    """Raise ValueError unless ``images`` match the record's image blocks one to one (count and size)."""
    if len(images) != len(record.image_blocks):
        raise ValueError(
            f"the record has {len(record.image_blocks)} image block(s) but {len(images)} image(s) came with "
            "it (records with images must come from Clef.prepare)"
        )
    for number, ((_, count), image) in enumerate(zip(record.image_blocks, images, strict=True)):
        if count != image.n_tokens:
            raise ValueError(f"image {number}: the record has {count} pad tokens, the image {image.n_tokens}")


def row_positions(record: EncodedRecord, images: Sequence[PreparedImage]) -> torch.Tensor | None:
    """The [3, T] M-RoPE planes of the record's row, or None for a text-only row (arange on every plane).
    Raises ValueError when the images do not match the record's blocks."""
    check_images(record, images)
    if not images:
        return None
    blocks = [
        (first_pad, image.pixels.merged_hw[0], image.pixels.merged_hw[1])
        for (first_pad, _), image in zip(record.image_blocks, images, strict=True)
    ]
    return mrope_positions(record.input_ids, blocks)


class ImageEmbedder:
    """The vision tower of a checkpoint, loaded on first use (text-only traffic never loads it).

    The first load holds `TRANSFORMERS_CONSTRUCTION_LOCK`: building a transformers module switches
    process-wide torch state, and two constructions at once (say the tower here and a model elsewhere) can
    leave torch's default dtype switched.
    """

    def __init__(self, tower: VisionTower) -> None:
        self.tower = tower
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        """Whether the tower's weights are in memory."""
        return self.tower.loaded

    def embed(self, images: Sequence[PreparedImage]) -> list[torch.Tensor]:
        """Tower rows of every image in one pass: fp32 CPU [n_tokens_i, hidden] each, in order.

        Raises FileNotFoundError / ValueError when the checkpoint has no usable vision tower.
        """
        if not images:
            return []
        with self._lock:
            if not self.tower.loaded:
                with TRANSFORMERS_CONSTRUCTION_LOCK:
                    self.tower.load()
        return self.tower.embed([image.pixels for image in images])
