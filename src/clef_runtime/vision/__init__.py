"""Images for the Clef backbone: safe decoding, preprocessing (native / g256 / g448), M-RoPE position planes
and the Qwen3.5 vision tower.

Pipeline for one request: ``protocol.images.extract_images`` (wire limits) -> :func:`decode_image` (pixel
limits, RGB) -> :func:`preprocess` (pixel_values + grid) -> :meth:`VisionTower.embed` (rows that replace the
``<|image_pad|>`` embeddings) and :func:`mrope_positions` (the (t, h, w) planes of the row).
"""

from clef_runtime.vision.decode import decode_image
from clef_runtime.vision.positions import mrope_positions
from clef_runtime.vision.preprocess import PreprocessedImage, preprocess
from clef_runtime.vision.tower import VisionTower

__all__ = ["PreprocessedImage", "VisionTower", "decode_image", "mrope_positions", "preprocess"]
