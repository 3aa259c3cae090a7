"""Warm-up shapes: what the engine runs at startup so that the first real request is not the slow one.

On CUDA the first call at a new shape pays for Triton autotuning (the fused DeltaNet kernels of the ``cuda``
extra: peers measured the first request at 20 s and more without a warm-up), cuBLAS heuristics and the
caching allocator's growth. Engine steps hold at most ``max_rows`` rows and
``max_step_tokens`` padded tokens, so the warm-up runs every (rows, tokens) pair of powers of two within
those limits, tokens from 64 to 4,096, continuing the constant prompt prefix as real requests do.

On CPU none of this is needed (no autotuning; the first call only pays for lazy initialisation, which one
small request covers), so the CPU warm-up stays that one request.
"""

from __future__ import annotations

from clef_runtime.engine.policy import DEFAULT_STEP_ROWS
from clef_runtime.model.backbone import ENDOFTEXT_ID, Backbone
from clef_runtime.model.state import BackboneState, Continuation

__all__ = ["WARMUP_TOKENS", "run_backbone_warmup", "warmup_shapes"]

#: Row lengths the CUDA warm-up runs (the server's usual requests: ~100 tokens to a few thousand).
WARMUP_TOKENS = (64, 256, 1024, 4096)


def warmup_shapes(
    device_type: str, *, max_step_tokens: int = 16384, max_rows: int = DEFAULT_STEP_ROWS
) -> list[tuple[int, int]]:
    """(rows, tokens) pairs to run at startup on ``device_type``: none on CPU; on CUDA every power-of-two
    row count up to ``max_rows`` times every length of `WARMUP_TOKENS` whose product fits
    ``max_step_tokens``."""
    if device_type == "cpu":
        return []
    shapes = []
    for tokens in WARMUP_TOKENS:
        rows = 1
        while rows <= max_rows and rows * tokens <= max_step_tokens:
            shapes.append((rows, tokens))
            rows *= 2
    return shapes


def run_backbone_warmup(
    backbone: Backbone, start: BackboneState | None, shapes: list[tuple[int, int]]
) -> int:
    """Run one batched continuation of ``start`` per (rows, tokens) shape (pad tokens: the values do not
    matter, the shapes do) and wait for the device. Returns the number of tokens run."""
    import torch

    total = 0
    for rows, tokens in shapes:
        backbone.extend(start, [Continuation([ENDOFTEXT_ID] * tokens) for _ in range(rows)])
        total += rows * tokens
    if backbone.device.type == "cuda":
        torch.cuda.synchronize(backbone.device)
    return total
