"""The engine's image preparation: modes and caps, digests, row positions, tower loading under the
construction lock."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from clef_runtime.encoding.encoder import EncodedRecord
from clef_runtime.engine.images import (
    ImageEmbedder,
    ImageSettings,
    PreparedImage,
    check_images,
    load_processor_config,
    prepare_images,
    row_positions,
)
from clef_runtime.model.backbone import TRANSFORMERS_CONSTRUCTION_LOCK
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.images import ImageSource
from clef_runtime.vision.preprocess import PreprocessedImage


def png_source(
    width: int, height: int, seed: int = 0, loc: tuple[str | int, ...] = ("images", 0)
) -> ImageSource:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return ImageSource(data=buffer.getvalue(), content_type="image/png", loc=loc)


def record_with_blocks(length: int, blocks: list[tuple[int, int]]) -> EncodedRecord:
    return EncodedRecord(
        input_ids=tuple(range(length)),
        questions=(),
        truncated_state_tokens=0,
        state_start=36,
        state_end=length - 5,
        image_blocks=tuple(blocks),
    )


def fake_image(grid_h: int, grid_w: int, digest: bytes = b"d" * 32) -> PreparedImage:
    pixels = PreprocessedImage(
        pixel_values=torch.zeros(4 * grid_h * grid_w, 1536),
        grid_thw=(1, 2 * grid_h, 2 * grid_w),
        merged_hw=(grid_h, grid_w),
        n_tokens=grid_h * grid_w,
    )
    return PreparedImage(pixels=pixels, digest=digest)


@pytest.mark.parametrize(
    ("mode", "max_tokens", "size", "expected_tokens"),
    [
        ("g256", None, (50, 30), 64),  # fixed 8x8 tile, aspect not kept
        ("g448", 1024, (500, 900), 196),  # fixed 14x14 tile
        ("native", 1024, (64, 48), 70),  # upscaled to at least 65,536 px: 320x224 -> 10x7
        ("native", 1024, (320, 320), 100),  # 10x10, already on the grid
    ],
)
def test_modes_give_the_expected_token_counts(
    mode: str, max_tokens: int | None, size: tuple[int, int], expected_tokens: int
) -> None:
    (image,) = prepare_images([png_source(*size)], ImageSettings(mode=mode, max_tokens=max_tokens))
    assert image.n_tokens == expected_tokens
    assert image.pixels.merged_hw[0] * image.pixels.merged_hw[1] == expected_tokens
    assert len(image.digest) == 32


def test_native_cap_bounds_the_tokens() -> None:
    source = png_source(1000, 700)
    (uncapped,) = prepare_images([source], ImageSettings(mode="native", max_tokens=None))
    (capped,) = prepare_images([source], ImageSettings(mode="native", max_tokens=256))
    assert uncapped.n_tokens == 31 * 22  # smart_resize: 992 x 704 -> 31 x 22 merged tokens
    assert capped.n_tokens <= 256
    assert capped.digest != uncapped.digest


def test_digest_follows_the_pixels() -> None:
    settings = ImageSettings(mode="g256")
    a, a_again, b = prepare_images(
        [png_source(60, 60, 1), png_source(60, 60, 1), png_source(60, 60, 2)], settings
    )
    assert a.digest == a_again.digest
    assert a.digest != b.digest
    assert a.n_tokens == b.n_tokens  # same ids, different pictures: only the digest tells them apart


def test_bad_image_names_its_location() -> None:
    broken = ImageSource(data=b"\x89PNG\r\n\x1a\nnot really", content_type="image/png", loc=("state", 3))
    with pytest.raises(RequestValidationError) as info:
        prepare_images([png_source(40, 40), broken], ImageSettings())
    assert info.value.errors[0]["loc"] == ("state", 3)


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="image mode"):
        ImageSettings(mode="g512")
    with pytest.raises(ValueError, match="at least"):
        ImageSettings(max_tokens=10)


def test_row_positions_follow_the_seed_closed_form() -> None:
    # One image at index 36 (first pad 37), merged grid H x W: text after the block is shifted down by
    # H*W - max(H, W); pad k gets (37, 37 + k // W, 37 + k % W) (docs/model.md section 5).
    grid_h, grid_w = 3, 5
    n = grid_h * grid_w
    length = 37 + n + 30
    record = record_with_blocks(length, [(37, n)])
    planes = row_positions(record, [fake_image(grid_h, grid_w)])
    assert planes is not None
    start, amount = 37 + n, n - max(grid_h, grid_w)
    for index in range(length):
        if 37 <= index < 37 + n:
            k = index - 37
            expected = (37, 37 + k // grid_w, 37 + k % grid_w)
        else:
            position = index - amount * (index >= start)
            expected = (position, position, position)
        assert tuple(planes[:, index].tolist()) == expected


def test_row_positions_text_only_is_none_and_mismatches_raise() -> None:
    assert row_positions(record_with_blocks(50, []), []) is None
    with pytest.raises(ValueError, match="image block"):
        check_images(record_with_blocks(60, [(37, 6)]), [])
    with pytest.raises(ValueError, match="pad tokens"):
        check_images(record_with_blocks(60, [(37, 6)]), [fake_image(2, 2)])


def test_load_processor_config(tmp_path: Path) -> None:
    assert load_processor_config(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    assert load_processor_config(tmp_path) == {"patch_size": 16}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {}}))
    assert load_processor_config(tmp_path) == {"image_processor": {}}  # the processor file wins
    (tmp_path / "processor_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_processor_config(tmp_path)


class _RecordingTower:
    """Stands in for VisionTower: records whether the construction lock was held during load()."""

    def __init__(self) -> None:
        self.loaded = False
        self.lock_held_during_load: bool | None = None
        self.embedded: list[Any] = []

    def load(self) -> None:
        # Another thread cannot take the lock while this one holds it.
        outcome: list[bool] = []

        def probe() -> None:
            took = TRANSFORMERS_CONSTRUCTION_LOCK.acquire(blocking=False)
            if took:
                TRANSFORMERS_CONSTRUCTION_LOCK.release()
            outcome.append(took)

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        self.lock_held_during_load = not outcome[0]
        self.loaded = True

    def embed(self, images: list[PreprocessedImage]) -> list[torch.Tensor]:
        self.embedded.append(images)
        return [torch.zeros(image.n_tokens, 8) for image in images]


def test_embedder_loads_the_tower_once_under_the_construction_lock() -> None:
    tower = _RecordingTower()
    embedder = ImageEmbedder(tower)  # type: ignore[arg-type]
    assert embedder.embed([]) == []
    assert not embedder.loaded  # nothing to embed: nothing loaded
    rows = embedder.embed([fake_image(2, 3), fake_image(1, 1)])
    assert [tuple(r.shape) for r in rows] == [(6, 8), (1, 8)]
    assert tower.lock_held_during_load is True
    tower.lock_held_during_load = None
    embedder.embed([fake_image(1, 2)])
    assert tower.lock_held_during_load is None  # loaded already: no second load
    assert len(tower.embedded) == 2
