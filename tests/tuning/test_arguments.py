"""``clef tune``'s settings: one record with its defaults and checks, whose fields are the command's flags."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from clef_runtime.cli import build_parser
from clef_runtime.tuning.arguments import DEFAULT_LR, TuneSettings, TuneSettingsError


def _parsed(*flags: str) -> TuneSettings:
    return TuneSettings.from_args(build_parser().parse_args(["tune", "cases.jsonl", "--out", "o", *flags]))


def test_the_flags_default_to_the_settings_defaults() -> None:
    assert _parsed() == TuneSettings()
    assert TuneSettings().learning_rate == DEFAULT_LR[TuneSettings().tier]


def test_every_setting_is_a_flag() -> None:
    defaults = TuneSettings()
    flags = {
        "--" + item.name.replace("_", "-"): str(
            getattr(defaults, item.name) + 1 if item.type == "int" else 0.125
        )
        for item in fields(TuneSettings)
        if item.name != "tier"
    }
    settings = _parsed("--tier", "scorer", *(part for pair in flags.items() for part in pair))
    assert settings.tier == "scorer"
    for item in fields(TuneSettings):
        if item.name != "tier":
            assert getattr(settings, item.name) == float(flags["--" + item.name.replace("_", "-")]), item.name
    assert settings.learning_rate == 0.125


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tier": "best"}, "--tier must be one of scalars, scorer, full"),
        ({"epochs": 0}, "--epochs must be at least 1"),
        ({"patience": 0}, "--patience must be at least 1"),
        ({"feature_batch_size": 0}, "--feature-batch-size must be at least 1"),
        ({"holdout_fraction": 0.0}, "--holdout-fraction must be between 0 and 1"),
        ({"lr": float("nan")}, "--lr must be a positive number"),
        ({"label_smoothing": 1.0}, "--label-smoothing must be in [0, 1)"),
        ({"ordinal_weight": -1.0}, "loss weights must be at least 0"),
        ({"weight_decay": -0.5}, "--weight-decay must be at least 0"),
    ],
)
def test_a_setting_out_of_range_names_its_flag(values: dict[str, Any], message: str) -> None:
    with pytest.raises(TuneSettingsError) as info:
        TuneSettings(**values)
    assert str(info.value) == message
