"""A batched prefill advanced a few tokens at a time (the engine's steps) equals one pass over each row.

The reference is the one-pass ``hidden_states`` (no cache, no chunks) and, for one row, the independent
implementation of the text stack in ``test_backbone`` (per-token gated delta rule, explicit attention).
"""

from __future__ import annotations

import pytest
import torch

from clef_runtime.model.backbone import Backbone
from clef_runtime.model.prefill import BatchPrefill
from clef_runtime.model.state import Continuation
from tests.model.test_backbone import _ids, _max_diff, _Reference, _state_tensors

TOL = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_dir) -> _Reference:  # type: ignore[no-untyped-def]
    return _Reference(tiny_dir)


def test_rows_advanced_in_uneven_chunks_equal_one_pass(
    tiny_backbone: Backbone, reference: _Reference
) -> None:
    prefix_ids = _ids(36, seed=50)
    rows = [prefix_ids + _ids(n, seed=51 + n) for n in (300, 45, 170)]
    prefix = tiny_backbone.initial_state(prefix_ids)
    prefill = BatchPrefill(tiny_backbone, prefix, [Continuation(r[36:]) for r in rows])
    completed: list[list[int]] = []
    for tokens in (17, 64, 100, 5, 1000):  # boundaries nowhere near the DeltaNet chunk grid
        completed.append(prefill.advance(tokens))
        for number in prefill.alive:
            assert prefill.remaining(number) == len(rows[number]) - 36 - prefill.done
    # Each row completes (and leaves the batch) in the advance that computes its last token.
    assert completed == [[], [1], [2], [], [0]]  # done: 17, 81, 181, 186, then the rest
    assert prefill.finished and prefill.advance(10) == []
    for number, row in enumerate(rows):
        one_pass = tiny_backbone.hidden_states(row)[36:]
        assert _max_diff(prefill.result(number).hidden, one_pass) <= TOL
    independent = reference.hidden(rows[0])[36:]
    assert _max_diff(prefill.result(0).hidden, independent) <= TOL


def test_points_taken_across_advances_resume_exactly(tiny_backbone: Backbone) -> None:
    ids = _ids(200, seed=60)
    full = tiny_backbone.hidden_states(ids)
    prefix = tiny_backbone.initial_state(ids[:36])
    row = Continuation(ids[36:], points=(30, 90), snapshot_at=90)
    stepped = BatchPrefill(tiny_backbone, prefix, [row])
    while not stepped.finished:
        stepped.advance(40)  # 30 and 90 fall inside advances: the calls are split there
    (whole,) = tiny_backbone.extend(prefix, [row])
    result = stepped.result(0)
    assert result.segment is not None and whole.segment is not None and result.snapshot is not None
    assert _max_diff(result.segment.hidden, whole.segment.hidden) <= 1e-5
    state = prefix.assemble([result.segment], result.points[1])
    assert state.length == 126 and state.next_position == 126
    assert all(
        _max_diff(a, b) <= 1e-5
        for a, b in zip(_state_tensors(state), _state_tensors(result.snapshot), strict=True)
    )
    (resumed,) = tiny_backbone.extend(state, [Continuation(ids[126:])])
    assert _max_diff(resumed.hidden, full[126:]) <= TOL


def test_a_dropped_row_leaves_the_others_unchanged(tiny_backbone: Backbone) -> None:
    prefix_ids = _ids(36, seed=70)
    rows = [prefix_ids + _ids(n, seed=71 + n) for n in (120, 140, 90)]
    prefix = tiny_backbone.initial_state(prefix_ids)
    prefill = BatchPrefill(tiny_backbone, prefix, [Continuation(r[36:]) for r in rows])
    prefill.advance(32)
    prefill.drop([1])  # a cancelled request: out of the batch between two chunks
    assert prefill.alive == (0, 2) and prefill.remaining(1) == 0
    while not prefill.finished:
        prefill.advance(48)
    with pytest.raises(KeyError):
        prefill.result(1)
    for number in (0, 2):
        assert _max_diff(prefill.result(number).hidden, tiny_backbone.hidden_states(rows[number])[36:]) <= TOL


def test_image_rows_are_merged_into_the_chunk_they_fall_in(tiny_backbone: Backbone) -> None:
    ids = _ids(90, seed=40)
    image = torch.randn(12, 64, generator=torch.Generator().manual_seed(41))
    embeds = tiny_backbone.embeddings(ids, image_rows=[(40, image)])
    expected = tiny_backbone.hidden_states(ids, inputs_embeds=embeds)
    prefix = tiny_backbone.initial_state(ids[:36])
    prefill = BatchPrefill(tiny_backbone, prefix, [Continuation(ids[36:], image_rows=[(4, image)])])
    for tokens in (7, 3, 20):  # the image block (4..15 of the row) is cut by two boundaries
        prefill.advance(tokens)
    prefill.advance()
    assert _max_diff(prefill.result(0).hidden, expected[36:]) <= TOL


def test_bad_arguments(tiny_backbone: Backbone) -> None:
    prefix = tiny_backbone.initial_state([1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        BatchPrefill(tiny_backbone, prefix, [])
    with pytest.raises(ValueError, match="image rows"):
        BatchPrefill(tiny_backbone, prefix, [Continuation([5, 6], image_rows=[(1, torch.zeros(2, 64))])])
    prefill = BatchPrefill(tiny_backbone, prefix, [Continuation([5, 6])])
    with pytest.raises(ValueError, match="tokens"):
        prefill.advance(0)
