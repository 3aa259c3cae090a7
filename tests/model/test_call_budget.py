"""Backbone.extend caps rows x tokens per model call: where it splits, and that splitting changes nothing."""

from __future__ import annotations

import pytest
import torch

from clef_runtime.model.backbone import DEFAULT_MAX_CALL_TOKENS, Backbone, call_width
from clef_runtime.model.state import Continuation


def _ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151_000, (length,), generator=generator).tolist()


def test_call_width_keeps_rows_times_tokens_within_the_budget() -> None:
    assert call_width(1, 4096) == 4096
    assert call_width(16, 4096) == 256
    assert call_width(3, 1000) == 320  # 333 rounded down to the 64-token Gated DeltaNet chunk
    assert call_width(100, 4096) == 64  # never below one chunk, even when the budget is exceeded
    assert call_width(5, None) is None
    with pytest.raises(ValueError, match="max_call_tokens"):
        call_width(2, 0)
    with pytest.raises(ValueError, match="rows"):
        call_width(0, 4096)


def test_the_default_budget_applies(tiny_backbone: Backbone) -> None:
    assert tiny_backbone.max_call_tokens == DEFAULT_MAX_CALL_TOKENS
    prefix = tiny_backbone.initial_state(_ids(36, seed=1))
    rows = [Continuation(_ids(300, seed=2 + n)) for n in range(16)]  # 16 x 300 > 4,096: 256-token calls
    before = tiny_backbone.calls
    tiny_backbone.extend(prefix, rows)
    assert tiny_backbone.calls - before == 2


def test_a_split_batch_equals_one_call_and_rows_alone(tiny_backbone: Backbone) -> None:
    prefix_ids = _ids(36, seed=3)
    prefix = tiny_backbone.initial_state(prefix_ids)
    tails = [_ids(n, seed=10 + n) for n in (300, 200, 251)]
    rows = [Continuation(tail, snapshot_at=150 if n == 1 else None) for n, tail in enumerate(tails)]

    before = tiny_backbone.calls
    split = tiny_backbone.extend(prefix, rows, max_call_tokens=3 * 64)
    # 64-token calls up to 300 (5 calls) plus the split at the snapshot (150 is inside 128..192): 6.
    assert tiny_backbone.calls - before == 6
    before = tiny_backbone.calls
    whole = tiny_backbone.extend(prefix, rows, max_call_tokens=None)
    assert tiny_backbone.calls - before == 2  # the snapshot cut only

    for tail, a, b in zip(tails, split, whole, strict=True):
        alone = tiny_backbone.hidden_states(prefix_ids + tail)[36:]  # one full pass of the row alone
        assert (a.hidden - b.hidden).abs().max().item() <= 1e-5
        assert (a.hidden - alone).abs().max().item() <= 1e-4
    assert split[1].snapshot is not None and whole[1].snapshot is not None
    assert (split[1].snapshot.hidden - whole[1].snapshot.hidden).abs().max().item() <= 1e-5
    # Continuing the snapshot taken in a split batch gives the row's own rest.
    (rest,) = tiny_backbone.extend(split[1].snapshot, [Continuation(tails[1][150:])])
    assert (rest.hidden - whole[1].hidden[150:]).abs().max().item() <= 1e-5
