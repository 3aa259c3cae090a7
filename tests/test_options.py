"""One options object: every engine option reaches every entry point (CLI flag, CLEF_* variable,
Clef.load)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from clef_runtime.cli import build_parser
from clef_runtime.options import (
    ENCODE_OPTION_FIELDS,
    ENGINE_OPTIONS,
    EngineOptions,
    OptionsError,
    option_table_markdown,
)


def subcommand_flags(name: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {flag for action in sub.choices[name]._actions for flag in action.option_strings}


def test_every_engine_field_has_exactly_one_option() -> None:
    fields = {f.name for f in dataclasses.fields(EngineOptions)} - {"pad_last_chunk", "check_memory"}
    assert fields == {option.field for option in ENGINE_OPTIONS}
    assert all(option.env == "CLEF_" + option.field.upper() for option in ENGINE_OPTIONS)
    assert all(option.flag == "--" + option.field.replace("_", "-") for option in ENGINE_OPTIONS)


@pytest.mark.parametrize("command", ["decide", "serve", "bench", "eval", "calibrate", "tune", "mcp"])
def test_model_subcommands_take_every_engine_option(command: str) -> None:
    flags = subcommand_flags(command)
    assert "--model" in flags
    assert {option.flag for option in ENGINE_OPTIONS} <= flags


def test_encode_takes_the_encoding_options() -> None:
    flags = subcommand_flags("encode")
    expected = {o.flag for o in ENGINE_OPTIONS if o.field in ENCODE_OPTION_FIELDS}
    assert expected == {"--max-length", "--image-mode", "--image-max-tokens"}
    assert expected <= flags


def test_flags_beat_variables_beat_defaults() -> None:
    parser = build_parser()
    args = parser.parse_args(["decide", "--weights", "fp32", "--prefill-chunk", "64"])
    environ = {"CLEF_WEIGHTS": "bf16-storage", "CLEF_CACHE_MB": "12.5", "CLEF_DEVICE": "cuda:1"}
    options = EngineOptions.from_sources(args, environ)
    assert options.weights == "fp32"
    assert options.prefill_chunk == 64
    assert options.cache_mb == 12.5
    assert options.device == "cuda:1"
    assert options.image_mode == "native"


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"device": "gpu"}, "--device"),
        ({"weights": "fp4"}, "--weights"),
        ({"int8_layers": "early"}, "--int8-layers"),
        ({"prefill_chunk": 0}, "--prefill-chunk"),
        ({"max_length": 0}, "--max-length"),
        ({"cache_mb": -1.0}, "--cache-mb"),
        ({"image_mode": "g512"}, "--image-mode"),
        ({"image_max_tokens": 0}, "--image-max-tokens"),
        ({"confidence": "vibes"}, "--confidence"),
        ({"snapshot_interval": -1}, "--snapshot-interval"),
    ],
)
def test_bad_values_name_their_flag(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(OptionsError, match=needle):
        EngineOptions().replace(**changes)


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="colour"):
        EngineOptions().replace(colour="red")


def test_bad_variable_is_named() -> None:
    with pytest.raises(OptionsError, match="CLEF_PREFILL_CHUNK"):
        EngineOptions.from_sources(None, {"CLEF_PREFILL_CHUNK": "many"})


def test_clef_load_takes_the_options_object_and_keywords() -> None:
    from clef_runtime.engine.clef import Clef

    signature = inspect.signature(Clef.load)
    assert list(signature.parameters)[:2] == ["model", "options"]
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def test_option_table_lists_every_flag_and_variable() -> None:
    table = option_table_markdown(ENGINE_OPTIONS)
    assert all(o.flag in table and o.env in table for o in ENGINE_OPTIONS)
