"""The feature cache: a row's backbone features are computed once (a second run, with any settings, reads
them from disk: the backbone's token counter does not move), an interrupted pass resumes where it stopped,
keys follow the model and the input, files hold what was computed, and a damaged file is recomputed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from clef_runtime.engine.clef import Clef
from clef_runtime.evaluation.cases import load_cases
from clef_runtime.tuning.features import (
    FeatureStore,
    RowFeatures,
    compute_features,
    model_fingerprint,
    row_key,
)
from clef_runtime.tuning.rows import prepare_rows
from tests.tuning.conftest import tune_in_process
from tests.tuning.tasks import billing_cases, write_cases


class CountingClef:
    """The tiny model, counting backbone calls; ``fail_on``: the call that raises KeyboardInterrupt."""

    def __init__(self, clef: Clef, fail_on: int | None = None) -> None:
        self.clef = clef
        self.calls = 0
        self.fail_on = fail_on

    def hidden_rows(self, items: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_on:
            raise KeyboardInterrupt
        return self.clef.hidden_rows(items)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.clef, name)


def _rows(clef: Clef, tmp_path: Path, count: int, seed: int = 7) -> tuple[list[Any], dict[str, Any]]:
    cases = load_cases(write_cases(tmp_path / f"cases-{seed}.jsonl", billing_cases(count, seed, "f")))
    fingerprint = model_fingerprint(clef)
    rows, prepared, problems = prepare_rows(clef.prepare, cases, lambda p: row_key(fingerprint, p))
    assert not problems
    return rows, prepared


def test_a_second_pass_reads_everything_from_disk(tiny: Clef, tmp_path: Path) -> None:
    rows, prepared = _rows(tiny, tmp_path, 10)
    store = FeatureStore(tmp_path / "cache")
    first = CountingClef(tiny)
    stats = compute_features(first, rows, prepared, store, batch_size=4)
    assert (stats.computed, stats.cached, first.calls) == (10, 0, 3)
    tokens = tiny.backbone_tokens
    second = CountingClef(tiny)
    stats = compute_features(second, rows, prepared, store, batch_size=4)
    assert (stats.computed, stats.cached, second.calls) == (0, 10, 0)
    assert tiny.backbone_tokens == tokens
    # What was stored is what the backbone computes (alone and from the state cache now, in a batch of 4
    # then: the same numbers up to fp32 summation order).
    (hidden,) = tiny.hidden_rows([prepared[rows[0].key]])
    stored = store.read(rows[0].key, rows[0].layout)
    assert stored is not None and stored.hidden.dtype == torch.float32
    torch.testing.assert_close(stored.hidden, hidden, rtol=0, atol=1e-4)
    assert stored.layout == rows[0].layout


def test_a_second_tuning_run_does_not_run_the_backbone(tiny: Clef, tmp_path: Path) -> None:
    train = write_cases(tmp_path / "train.jsonl", billing_cases(16, 11, "a"))
    cache = tmp_path / "shared-cache"
    first = tune_in_process(
        tiny, train, tmp_path / "one", "--tier", "scalars", "--epochs", "1", cache_dir=cache
    )
    assert first["features"] == {"computed": 16, "cached": 0, "cache_dir": str(cache)}
    tokens = tiny.backbone_tokens
    flags = ("--tier", "scorer", "--epochs", "2", "--lr", "0.01", "--seed", "3")
    second = tune_in_process(tiny, train, tmp_path / "two", *flags, cache_dir=cache)
    assert second["features"]["computed"] == 0 and second["features"]["cached"] == 16
    assert tiny.backbone_tokens == tokens


def test_an_interrupted_pass_resumes(tiny: Clef, tmp_path: Path) -> None:
    rows, prepared = _rows(tiny, tmp_path, 10, seed=8)
    store = FeatureStore(tmp_path / "cache")
    with pytest.raises(KeyboardInterrupt):
        compute_features(CountingClef(tiny, fail_on=2), rows, prepared, store, batch_size=4)
    files = list(store.directory.rglob("*.safetensors"))
    assert len(files) == 4  # the first batch, whole; nothing half-written
    assert not list(store.directory.rglob("*.tmp"))
    resumed = CountingClef(tiny)
    stats = compute_features(resumed, rows, prepared, store, batch_size=4)
    assert (stats.computed, stats.cached, resumed.calls) == (6, 4, 2)


def test_a_damaged_file_is_computed_again(tiny: Clef, tmp_path: Path) -> None:
    rows, prepared = _rows(tiny, tmp_path, 3, seed=9)
    store = FeatureStore(tmp_path / "cache")
    compute_features(tiny, rows, prepared, store, batch_size=8)
    store.path(rows[1].key).write_bytes(b"not a safetensors file")
    assert not store.has(rows[1].key) and store.read(rows[1].key) is None
    stats = compute_features(tiny, rows, prepared, store, batch_size=8)
    assert (stats.computed, stats.cached) == (1, 2)
    assert store.read(rows[1].key, rows[1].layout) is not None


def test_keys_follow_the_model_and_the_input(tiny: Clef, tmp_path: Path) -> None:
    rows, prepared = _rows(tiny, tmp_path, 2, seed=10)
    fingerprint = model_fingerprint(tiny)
    assert fingerprint["model"] == "tiny" and fingerprint["dtype"] == "fp32" and fingerprint["files"]
    first = prepared[rows[0].key]
    assert row_key(fingerprint, first) == rows[0].key != rows[1].key
    for change in ({"dtype": "bf16"}, {"weights": "int8"}, {"files": []}, {"device": "cuda"}):
        assert row_key({**fingerprint, **change}, first) != rows[0].key
    same_ids = replace(first, state_key=b"")  # another object with the same ids and images
    assert row_key(fingerprint, same_ids) == rows[0].key


def test_hidden_rows_are_stored_in_bf16_only_when_lossless(tmp_path: Path) -> None:
    from clef_runtime.model.head import HeadLayout

    store = FeatureStore(tmp_path)
    layout = HeadLayout(type_ids=[0], question_spans=[(0, 1)], option_spans=[[(1, 2), (2, 3)]])
    lexical = torch.randn(2, 8)
    exact = torch.randn(4, 8).to(torch.bfloat16).float()
    store.write("aa" + "0" * 62, RowFeatures(hidden=exact, lexical=lexical, layout=layout))
    wide = torch.randn(4, 8) / 3
    store.write("bb" + "0" * 62, RowFeatures(hidden=wide, lexical=lexical, layout=layout))
    narrow_read, wide_read = store.read("aa" + "0" * 62), store.read("bb" + "0" * 62)
    assert narrow_read is not None and wide_read is not None
    assert narrow_read.hidden.dtype == torch.bfloat16 and torch.equal(narrow_read.hidden.float(), exact)
    assert wide_read.hidden.dtype == torch.float32 and torch.equal(wide_read.hidden, wide)
    other = HeadLayout(type_ids=[0], question_spans=[(0, 1)], option_spans=[[(1, 2), (2, 4)]])
    assert store.read("aa" + "0" * 62, other) is None  # made for a row laid out otherwise: a miss


def test_the_fingerprint_records_the_quantised_layer_selection_only_where_layers_are_quantised() -> None:
    # The card's label reads "int8 layers ..., fp32", never a bare "int8": the selection is read from the
    # options' weight mode, so an int8 engine's features are keyed by the layers it quantised.
    int8 = Clef.load("tiny", weights="int8", int8_layers="all", cache_mb=0)
    assert model_fingerprint(int8)["int8_layers"] == "all"
    assert model_fingerprint(Clef.load("tiny", weights="fp32", cache_mb=0))["int8_layers"] is None
