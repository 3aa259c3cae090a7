"""The head's tuning paths: `training_logits` and `option_features` + `option_logits` are the scoring forward
(the same numbers as `score_batch`, which the loop reference in test_head.py pins), gradients reach every
parameter, and `save_files` writes a head that `from_files` loads strictly and bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from clef_runtime.model.head import (
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    JointSchemaHead,
    OptionFeatures,
    read_head_config,
)
from tests.model.test_head import SMALL_CONFIG, _random_record, _randomized_head


def _records() -> list[tuple[torch.Tensor, object, torch.Tensor]]:
    return [
        _random_record(20, type_ids=[1, 0], option_counts=[4, 2]),
        _random_record(21, type_ids=[2, 0, 1], option_counts=[5, 2, 3]),
    ]


def test_training_logits_are_the_scoring_forward_with_gradients() -> None:
    head = _randomized_head(7, 1.2, 0.9, 0.3)
    head.memory_chunk_rows = 5  # the block-wise memory projection, differentiable
    hiddens, layouts, lexicals = zip(*_records(), strict=True)
    scored = head.score_batch(hiddens, layouts, lexicals)
    trained = head.training_logits(hiddens, layouts, lexicals)
    for a, b in zip(scored, trained, strict=True):
        assert torch.equal(a, b.detach())
    sum(t.square().sum() for t in trained).backward()
    missing = [name for name, p in head.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"


def test_option_features_then_logits_equal_the_scores() -> None:
    head = _randomized_head(8, 0.4, 2.0, -0.2)
    hiddens, layouts, lexicals = zip(*_records(), strict=True)
    features = head.option_features(hiddens, layouts, lexicals)
    assert [f.num_options for f in features] == [layout.num_options for layout in layouts]
    scored = head.score_batch(hiddens, layouts, lexicals)
    for f, logits in zip(features, scored, strict=True):
        torch.testing.assert_close(head.option_logits(f), logits, rtol=0, atol=1e-6)
    joined = OptionFeatures.cat(features)
    torch.testing.assert_close(head.option_logits(joined), torch.cat(scored), rtol=0, atol=1e-6)
    # Only the scorer and the scalars come after the features: their gradients, nobody else's.
    head.option_logits(joined).sum().backward()
    with_grad = {name for name, p in head.named_parameters() if p.grad is not None}
    assert with_grad == {
        "prior_logit_scale",
        "joint_logit_scale",
        "residual_gate",
        "residual_scorer.0.weight",
        "residual_scorer.0.bias",
        "residual_scorer.3.weight",
        "residual_scorer.3.bias",
    }


def test_save_files_round_trips_strictly(tmp_path) -> None:
    head = _randomized_head(9, 1.0, 1.0, 0.5)
    head.save_files(tmp_path / "head")
    assert read_head_config(tmp_path / "head" / HEAD_CONFIG_FILE) == SMALL_CONFIG
    assert json.loads((tmp_path / "head" / HEAD_CONFIG_FILE).read_text()) == SMALL_CONFIG
    assert not list((tmp_path / "head").glob("*.tmp"))
    loaded = JointSchemaHead.from_files(tmp_path / "head")
    assert (tmp_path / "head" / HEAD_WEIGHTS_FILE).is_file()
    original, reloaded = head.state_dict(), loaded.state_dict()
    assert original.keys() == reloaded.keys()
    for name, value in original.items():
        assert reloaded[name].dtype == torch.float32
        assert torch.equal(value, reloaded[name]), name


def test_empty_batches_and_mismatches() -> None:
    head = JointSchemaHead(**SMALL_CONFIG)
    assert head.training_logits([], [], []) == []
    assert head.option_features([], [], []) == []
    hidden, layout, lexical = _records()[0]
    with pytest.raises(ValueError, match="option_lexical"):
        head.training_logits([hidden], [layout], [lexical[:1]])
