"""Server settings: every flag has a CLEF_* variable, a flag beats its variable, bad values are named."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from clef_runtime.options import EngineOptions
from clef_runtime.server.cli import add_serve_arguments, run_serve
from clef_runtime.server.settings import (
    ALL_SERVE_OPTIONS,
    ServerSettings,
    SettingsError,
    parse_bool,
    parse_size,
    settings_from_namespace,
)


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ServerSettings:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return settings_from_namespace(parser.parse_args(argv), environ or {})


# A valid non-default value per option: (flag arguments, environment value, expected field value).
SAMPLES: dict[str, tuple[list[str], str, Any]] = {
    "model": (["--model", "tiny"], "tiny", "tiny"),
    "host": (["--host", "0.0.0.0"], "0.0.0.0", "0.0.0.0"),
    "port": (["--port", "9000"], "9000", 9000),
    "api_keys": (["--api-key", "a", "--api-key", "b"], "a, b", ("a", "b")),
    "max_queue": (["--max-queue", "3"], "3", 3),
    "max_batch_tokens": (["--max-batch-tokens", "999"], "999", 999),
    "max_batch_size": (["--max-batch-size", "4"], "4", 4),
    "max_input_tokens": (["--max-input-tokens", "77"], "77", 77),
    "max_body_bytes": (["--max-body-bytes", "2MiB"], "2MiB", 2 * 1024 * 1024),
    "deterministic": (["--deterministic"], "1", True),
    "device": (["--device", "cuda:1"], "cuda:1", "cuda:1"),
    "prefill_chunk": (["--prefill-chunk", "64"], "64", 64),
    "max_length": (["--max-length", "4096"], "4096", 4096),
    "on_overflow": (["--on-overflow", "reject"], "reject", "reject"),
    "cache_mb": (["--cache-mb", "0"], "0", 0.0),
    "image_mode": (["--image-mode", "g448"], "g448", "g448"),
    "image_max_tokens": (["--image-max-tokens", "256"], "256", 256),
    "weights": (["--weights", "bf16-storage"], "bf16-storage", "bf16-storage"),
    "int8_layers": (["--int8-layers", "1,2"], "1,2", "1,2"),
    "fused_kernels": (["--no-fused-kernels"], "0", False),
    "snapshot_interval": (["--snapshot-interval", "128"], "128", 128),
    "confidence": (["--confidence", "workers-ai"], "workers-ai", "workers-ai"),
    "calibration": (["--calibration", "cal.json"], "cal.json", "cal.json"),
    "batch_window_ms": (["--batch-window-ms", "2.5"], "2.5", 2.5),
    "log_requests": (["--log-requests"], "true", True),
    "latency_ms": (["--latency-ms"], "1", True),
    "jobs": (["--jobs", "off"], "off", False),
    "jobs_db": (["--jobs-db", "/tmp/j.sqlite3"], "/tmp/j.sqlite3", "/tmp/j.sqlite3"),
    "jobs_max_lines": (["--jobs-max-lines", "10"], "10", 10),
    "jobs_max_bytes": (["--jobs-max-bytes", "1MiB"], "1MiB", 1024 * 1024),
    "jobs_max_active": (["--jobs-max-active", "2"], "2", 2),
    "jobs_batch_size": (["--jobs-batch-size", "4"], "4", 4),
    "log_level": (["--log-level", "debug"], "DEBUG", "debug"),
    "ray": (["--ray"], "1", True),
    "replicas": (["--replicas", "3"], "3", 3),
    "min_replicas": (["--min-replicas", "1"], "1", 1),
    "max_replicas": (["--max-replicas", "4"], "4", 4),
    "ray_address": (["--ray-address", "auto"], "auto", "auto"),
    "ray_num_cpus": (["--ray-num-cpus", "0.5"], "0.5", 0.5),
    "ray_num_gpus": (["--ray-num-gpus", "1"], "1", 1.0),
    "ray_routing": (["--ray-routing", "power-of-two"], "power-of-two", "power-of-two"),
    "ray_max_owner_queue": (["--ray-max-owner-queue", "3"], "3", 3),
}


def value_of(settings: ServerSettings, field: str) -> Any:
    """A server field, or an engine option (nested under ``settings.engine``)."""
    if field in EngineOptions.__dataclass_fields__:
        return getattr(settings.engine, field)
    return getattr(settings, field)


def test_every_option_is_sampled() -> None:
    assert set(SAMPLES) == {option.field for option in ALL_SERVE_OPTIONS}
    assert all(
        option.env == "CLEF_" + option.field.upper() or option.field == "api_keys"
        for option in ALL_SERVE_OPTIONS
    )


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_each_option_comes_from_its_flag_or_its_variable(field: str) -> None:
    argv, env_value, expected = SAMPLES[field]
    option = next(o for o in ALL_SERVE_OPTIONS if o.field == field)
    base = [] if field == "model" else ["--model", "m"]
    assert value_of(parse(base + argv), field) == expected
    environ = {option.env: env_value} if field == "model" else {option.env: env_value, "CLEF_MODEL": "m"}
    assert value_of(parse([], environ), field) == expected


def test_defaults() -> None:
    settings = parse(["--model", "tiny"])
    assert (settings.host, settings.port, settings.api_keys) == ("127.0.0.1", 8094, ())
    assert (settings.on_overflow, settings.deterministic, settings.log_requests) == ("truncate", False, False)
    assert settings.max_length == settings.input_token_limit == 16384
    assert settings.max_body_bytes == 16 * 1024 * 1024
    assert not settings.auth_enabled


def test_a_flag_beats_its_variable() -> None:
    environ = {
        "CLEF_MODEL": "from-env",
        "CLEF_PORT": "1234",
        "CLEF_API_KEY": "env-key",
        "CLEF_DETERMINISTIC": "1",
    }
    settings = parse(
        ["--model", "flag", "--port", "4321", "--api-key", "flag-key", "--no-deterministic"], environ
    )
    assert (settings.model, settings.port, settings.api_keys, settings.deterministic) == (
        "flag",
        4321,
        ("flag-key",),
        False,
    )
    assert parse([], environ).port == 1234


def test_input_limit_is_the_smaller_of_max_length_and_max_input_tokens() -> None:
    assert parse(["--model", "m", "--max-input-tokens", "100"]).input_token_limit == 100
    assert parse(["--model", "m", "--max-input-tokens", "99999"]).input_token_limit == 16384
    options = parse(["--model", "m", "--max-input-tokens", "100", "--device", "cpu"]).engine_options()
    assert options == EngineOptions(max_length=100, device="cpu")
    options = parse(
        ["--model", "m", "--cache-mb", "64", "--image-mode", "g256", "--prefill-chunk", "8"]
    ).engine_options()
    assert options == EngineOptions(cache_mb=64.0, image_mode="g256", prefill_chunk=8)


@pytest.mark.parametrize(
    ("environ", "needle"),
    [
        ({"CLEF_PORT": "http"}, "CLEF_PORT"),
        ({"CLEF_DETERMINISTIC": "maybe"}, "CLEF_DETERMINISTIC"),
        ({"CLEF_MAX_BODY_BYTES": "lots"}, "CLEF_MAX_BODY_BYTES"),
        ({"CLEF_ON_OVERFLOW": "drop"}, "CLEF_ON_OVERFLOW"),
        ({"CLEF_MAX_QUEUE": "0"}, "--max-queue"),
        ({"CLEF_PORT": "70000"}, "--port"),
        ({"CLEF_LOG_LEVEL": "loud"}, "--log-level"),
        ({"CLEF_WEIGHTS": "fp8"}, "CLEF_WEIGHTS"),
        ({"CLEF_DEVICE": "gpu"}, "--device"),
        ({"CLEF_CACHE_MB": "-1"}, "--cache-mb"),
        ({"CLEF_INT8_LAYERS": "early"}, "--int8-layers"),
    ],
)
def test_bad_variables_are_named(environ: dict[str, str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        parse([], {"CLEF_MODEL": "m", **environ})


def test_model_is_required() -> None:
    with pytest.raises(SettingsError, match="--model is required"):
        parse([])


def test_bad_flags_exit_2_from_argparse() -> None:
    with pytest.raises(SystemExit) as info:
        parse(["--model", "m", "--on-overflow", "drop"])
    assert info.value.code == 2


def test_run_serve_returns_2_on_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert run_serve(parser.parse_args(["--model", "m", "--max-queue", "0"]), environ={}) == 2
    assert "--max-queue must be at least 1" in capsys.readouterr().err


def test_help_names_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    parser.print_help()
    text = capsys.readouterr().out
    assert all(option.env in text and option.flag in text for option in ALL_SERVE_OPTIONS)


def test_keys_are_redacted_in_logs() -> None:
    settings = parse(["--model", "m", "--api-key", "super-secret"])
    assert "super-secret" not in str(settings.redacted())


@pytest.mark.parametrize(
    ("text", "value"), [("123", 123), ("512k", 524288), ("8M", 8388608), ("8MiB", 8388608), ("1g", 1 << 30)]
)
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "8 MB of stuff", "-1", "1.5M"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_booleans() -> None:
    assert [parse_bool(t) for t in ("1", "TRUE", "yes", "on", "0", "false", "No", "off", "")] == [
        True
    ] * 4 + [False] * 5
    with pytest.raises(ValueError):
        parse_bool("2")
