"""`devtools.flags`: flags generated from the options tables mean, to the ``clef`` parser, exactly the
values they were generated from."""

from __future__ import annotations

from typing import Any

import pytest
from devtools.flags import engine_flags, engine_options, has_engine_option, serve_flags

from clef_runtime.cli import build_parser
from clef_runtime.options import ENGINE_OPTIONS, EngineOptions

# A value other than the default for every engine option (a new option must get one here).
NON_DEFAULT: dict[str, Any] = {
    "device": "cpu",
    "dtype": "fp32",
    "weights": "int8",
    "int8_layers": "all",
    "prefill_chunk": 64,
    "max_step_tokens": 256,
    "max_length": 321,
    "cache_mb": 12.5,
    "snapshot_interval": 0,
    "image_mode": "g256",
    "image_max_tokens": 7,
    "confidence": "typesafe",
    "explain_method": "attention",
    "fused_kernels": False,
    "calibration": "calibration.json",
    "head": ("tuned=/heads/tuned", "/heads/default"),
}


def test_every_engine_option_round_trips_through_the_cli_parser() -> None:
    assert set(NON_DEFAULT) == {option.field for option in ENGINE_OPTIONS}
    for field, value in NON_DEFAULT.items():
        args = build_parser().parse_args(["bench", *engine_flags(model="tiny", **{field: value})])
        assert args.model == "tiny"
        assert getattr(EngineOptions.from_sources(args, {}), field) == value, field
    args = build_parser().parse_args(["decide", *engine_flags(**NON_DEFAULT)])
    assert EngineOptions.from_sources(args, {}) == EngineOptions(**NON_DEFAULT)
    assert engine_options(**NON_DEFAULT) == EngineOptions(**NON_DEFAULT)


def test_a_bool_option_says_both_ways() -> None:
    assert engine_flags(fused_kernels=True) == ["--fused-kernels"]
    assert engine_flags(fused_kernels=False) == ["--no-fused-kernels"]
    assert engine_flags(cache_mb=None) == []  # None: the default applies


def test_serve_flags_reach_the_serve_parser() -> None:
    values = {
        "model": "tiny",
        "port": 8123,
        "cache_mb": 0.0,
        "max_queue": 3,
        "deterministic": True,
        "jobs_batch_size": 4,
        "api_keys": ["one", "two"],
        "log_level": "warning",
    }
    args = build_parser().parse_args(["serve", *serve_flags(**values)])
    for field, value in values.items():
        assert getattr(args, field) == value, field


def test_a_field_without_an_option_fails_loudly() -> None:
    with pytest.raises(KeyError, match="cache_size"):
        engine_flags(cache_size=1)
    with pytest.raises(KeyError, match="no_such_setting"):
        serve_flags(no_such_setting=1)
    with pytest.raises(TypeError):
        engine_options(cache_size=1)
    assert has_engine_option("cache_mb") and not has_engine_option("cache_size")
