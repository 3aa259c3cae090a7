"""Image helpers shared by the vision tests."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def photo_like(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth gradient with noise: resampling filters give visibly different results on it."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    base = x * np.array([0.7, 0.2, 0.4]) + y * np.array([0.2, 0.6, 0.5])
    pixels = np.clip(base + rng.normal(0, 30, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()
