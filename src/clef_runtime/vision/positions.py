"""M-RoPE position planes (t, h, w) for a row with image blocks, as transformers' Qwen3.5 ``get_rope_index``.

Rule (transformers 5.24 ``Qwen3_5Model.get_rope_index`` for images; docs/model.md section 5): the
row is split into runs of text tokens and image-pad blocks; a counter ``cur`` starts at 0.

- a text run of length L gets ``cur .. cur + L - 1`` on all three planes, then ``cur += L``;
- an image block with merged grid (H, W) gets, for its k-th pad token (row-major over the grid),
  ``t = cur``, ``h = cur + k // W``, ``w = cur + k % W``; then ``cur += max(H, W)``.

``<|vision_start|>`` / ``<|vision_end|>`` are text tokens. For one image whose first pad is at index 37 this
is the seed's closed form: text after the block is shifted down by ``H*W - max(H, W)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["mrope_positions"]


def mrope_positions(input_ids: Sequence[int], image_blocks: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """Position planes for one row.

    ``input_ids``: the row (only its length is used; pads may be ``<|image_pad|>`` or any mapped ids);
    ``image_blocks``: ``(first_pad_index, H, W)`` per image, H x W the merged grid, in row order.

    Returns an int64 tensor [3, T] (planes t, h, w).
    Raises ``ValueError`` when a block is empty, runs past the row, overlaps or touches the previous block
    (the reference always has ``<|vision_end|>``/``<|vision_start|>`` between images; transformers would
    merge two touching blocks into one group), or blocks are not in increasing order.
    """
    length = len(input_ids)
    positions = torch.empty((3, length), dtype=torch.int64)
    cursor = 0  # the next free position value
    index = 0  # the next unfilled token index (the end of the previous block, if any)
    for block_number, (first_pad, grid_h, grid_w) in enumerate(image_blocks):
        if grid_h < 1 or grid_w < 1:
            raise ValueError(f"image block at {first_pad} has an empty grid {grid_h}x{grid_w}")
        n_pads = grid_h * grid_w
        if first_pad < 0 or first_pad < index or (block_number > 0 and first_pad == index):
            raise ValueError(f"image block at {first_pad} overlaps, touches or precedes the previous block")
        if first_pad + n_pads > length:
            raise ValueError(f"image block at {first_pad} ({n_pads} pads) runs past the row length {length}")
        text_len = first_pad - index
        positions[:, index:first_pad] = torch.arange(cursor, cursor + text_len, dtype=torch.int64)
        cursor += text_len
        k = torch.arange(n_pads, dtype=torch.int64)
        block = slice(first_pad, first_pad + n_pads)
        positions[0, block] = cursor
        positions[1, block] = cursor + k // grid_w
        positions[2, block] = cursor + k % grid_w
        cursor += max(grid_h, grid_w)
        index = first_pad + n_pads
    positions[:, index:] = torch.arange(cursor, cursor + length - index, dtype=torch.int64)
    return positions
