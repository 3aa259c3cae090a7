"""mrope_positions against transformers' Qwen3_5Model.get_rope_index and against the seed's closed form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5Model

from clef_runtime.vision.positions import mrope_positions

VISION_START, VISION_END, IMAGE_PAD = 248_053, 248_054, 248_056


@pytest.fixture(scope="module")
def tiny_model() -> Qwen3_5Model:
    config = Qwen3_5Config(
        text_config={
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 16,
        },
    )
    return Qwen3_5Model(config).eval()


def random_row(rng: np.random.Generator, n_images: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Text, then per image <|vision_start|> pads <|vision_end|> and some text (the encoder's layout)."""
    ids = list(rng.integers(0, 248_000, int(rng.integers(1, 40))))
    blocks = []
    for _ in range(n_images):
        grid_h, grid_w = (int(v) for v in rng.integers(1, 13, 2))
        ids.append(VISION_START)
        blocks.append((len(ids), grid_h, grid_w))
        ids.extend([IMAGE_PAD] * (grid_h * grid_w))
        ids.append(VISION_END)
        ids.extend(rng.integers(0, 248_000, int(rng.integers(0, 30))))
    return [int(i) for i in ids], blocks


def transformers_positions(model, ids, blocks) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    mm_token_type_ids = (input_ids == IMAGE_PAD).int()
    grid_thw = torch.tensor([[1, 2 * h, 2 * w] for _, h, w in blocks])
    positions, _ = model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=grid_thw)
    return positions[:, 0]


def test_equals_transformers_get_rope_index_on_random_rows(tiny_model):
    rng = np.random.default_rng(0)
    for trial in range(60):
        ids, blocks = random_row(rng, n_images=1 + trial % 4)
        ours = mrope_positions(ids, blocks)
        assert ours.dtype == torch.int64 and tuple(ours.shape) == (3, len(ids))
        assert torch.equal(ours, transformers_positions(tiny_model, ids, blocks)), (trial, blocks)


def test_text_only_is_arange_on_all_planes():
    assert torch.equal(mrope_positions([5] * 7, []), torch.arange(7).expand(3, 7))


@pytest.mark.parametrize(("grid_h", "grid_w"), [(8, 8), (14, 14), (3, 7), (9, 2), (1, 1), (24, 32)])
def test_single_image_at_index_36_matches_the_seed_closed_form(grid_h, grid_w):
    n_pads = grid_h * grid_w
    length = 36 + 1 + n_pads + 1 + 50
    ids = [1] * length
    ours = mrope_positions(ids, [(37, grid_h, grid_w)])

    # The seed: rope_shift_start = 37 + H*W (the <|vision_end|> index), rope_shift_amount = H*W - max(H, W);
    # text position i - amount * [i >= start] on all planes; image token k -> (37, 37 + k // W, 37 + k % W).
    start = 37 + n_pads
    amount = n_pads - max(grid_h, grid_w)
    for i in range(length):
        if 37 <= i < 37 + n_pads:
            k = i - 37
            expected = (37, 37 + k // grid_w, 37 + k % grid_w)
        else:
            expected = (i - amount * (i >= start),) * 3
        assert tuple(ours[:, i].tolist()) == expected, i


@pytest.mark.parametrize(
    "blocks",
    [
        [(5, 0, 3)],  # empty grid
        [(8, 2, 2)],  # runs past the end (length 10)
        [(2, 2, 2), (4, 1, 1)],  # overlaps
        [(2, 2, 2), (6, 1, 1)],  # touches the previous block
        [(6, 1, 1), (2, 1, 1)],  # out of order
        [(-1, 1, 1)],
    ],
)
def test_invalid_blocks_are_refused(blocks):
    with pytest.raises(ValueError):
        mrope_positions([0] * 10, blocks)
