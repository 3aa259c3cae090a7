"""Training: a seed gives bitwise the same head, each tier moves only its own parameters (the rest stay the
starting head's, bit for bit), early stopping keeps the best epoch (the starting head when none is better),
and the session's shared head is never modified."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from clef_runtime.engine.clef import Clef
from clef_runtime.evaluation.cases import load_cases
from clef_runtime.model.head import JointSchemaHead
from clef_runtime.release import HEAD_WEIGHTS_FILE
from clef_runtime.tuning.features import FeatureStore, compute_features, model_fingerprint, row_key
from clef_runtime.tuning.rows import TuneRow, prepare_rows
from clef_runtime.tuning.trainer import TIER_PARAMETERS, TuningData, train_head, trainable_names
from tests.model.test_head import RELEASE_CONFIG
from tests.tuning.conftest import cli_settings, tune_in_process
from tests.tuning.tasks import billing_cases, write_cases

SCALARS = {"prior_logit_scale", "joint_logit_scale", "residual_gate"}
SCORER = SCALARS | {f"residual_scorer.{i}.{k}" for i in (0, 3) for k in ("weight", "bias")}


def _features(clef: Clef, tmp_path: Path, count: int, seed: int) -> tuple[list[TuneRow], list[Any]]:
    cases = load_cases(write_cases(tmp_path / "cases.jsonl", billing_cases(count, seed, "r")))
    fingerprint = model_fingerprint(clef)
    rows, prepared, _ = prepare_rows(clef.prepare, cases, lambda p: row_key(fingerprint, p))
    store = FeatureStore(tmp_path / "cache")
    compute_features(clef, rows, prepared, store, batch_size=8)
    return rows, [store.read(row.key, row.layout) for row in rows]


def _flipped(rows: list[TuneRow]) -> list[TuneRow]:
    """The same rows with every noul answer the other way round."""
    return [
        replace(row, questions=tuple(replace(q, target=1 - q.target) for q in row.questions)) for row in rows
    ]


def _state(head: JointSchemaHead) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in head.state_dict().items()}


def test_tier_names_on_the_release_geometry() -> None:
    with torch.device("meta"):
        head = JointSchemaHead(**RELEASE_CONFIG)
    every = [name for name, _ in head.named_parameters()]
    assert set(trainable_names(head, "scalars")) == SCALARS
    assert set(trainable_names(head, "scorer")) == SCORER
    assert trainable_names(head, "full") == every and len(every) == 122
    assert set(TIER_PARAMETERS) == {"scalars", "scorer", "full"}
    with pytest.raises(ValueError, match="unknown tier"):
        trainable_names(head, "everything")


@pytest.mark.parametrize(("tier", "allowed"), [("scalars", SCALARS), ("scorer", SCORER)])
def test_a_tier_moves_only_its_parameters(tiny: Clef, tmp_path: Path, tier: str, allowed: set[str]) -> None:
    rows, features = _features(tiny, tmp_path, 24, seed=21)
    start = _state(tiny.head)
    data = TuningData(rows, features, frozen_head=tiny.head)
    settings = replace(cli_settings("--tier", tier), epochs=3, patience=3)
    result = train_head(tiny.head, data, data, settings)  # the holdout is the training set: it improves
    assert result.best_epoch > 0 and result.trained == [
        n for n, _ in tiny.head.named_parameters() if n in allowed
    ]
    tuned = result.head.state_dict()
    changed = {name for name, value in start.items() if not torch.equal(value, tuned[name])}
    assert changed and changed <= allowed
    assert tier != "scorer" or any(name.startswith("residual_scorer") for name in changed)
    assert all(torch.equal(value, tiny.head.state_dict()[name]) for name, value in start.items())


def test_early_stopping_keeps_the_starting_head_when_nothing_is_better(tiny: Clef, tmp_path: Path) -> None:
    rows, features = _features(tiny, tmp_path, 24, seed=22)
    train = TuningData(rows, features, frozen_head=tiny.head)
    opposite = TuningData(_flipped(rows), features, frozen_head=tiny.head)
    settings = replace(cli_settings("--tier", "scorer", "--lr", "0.01"), epochs=10, patience=2)
    result = train_head(tiny.head, train, opposite, settings)
    assert (result.best_epoch, result.epochs_run, result.stopped_early) == (0, 2, True)
    assert [point.epoch for point in result.curve] == [0, 1, 2]
    assert result.curve[2].holdout_nll > result.curve[0].holdout_nll
    start = tiny.head.state_dict()
    assert all(torch.equal(value, start[name]) for name, value in result.head.state_dict().items())


def test_the_same_seed_writes_bitwise_the_same_head(tiny: Clef, tmp_path: Path) -> None:
    train = write_cases(tmp_path / "train.jsonl", billing_cases(24, 23, "d"))
    cache = tmp_path / "cache"
    flags = ("--tier", "full", "--epochs", "3", "--patience", "3", "--batch-size", "4")
    one = tune_in_process(tiny, train, tmp_path / "one", *flags, cache_dir=cache)
    two = tune_in_process(tiny, train, tmp_path / "two", *flags, cache_dir=cache)
    tune_in_process(tiny, train, tmp_path / "other", *flags, "--seed", "1", cache_dir=cache)
    assert one["best_epoch"] > 0
    weights = [(tmp_path / name / HEAD_WEIGHTS_FILE).read_bytes() for name in ("one", "two", "other")]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]  # another seed: another split and shuffle
    assert one["curve"] == two["curve"]
