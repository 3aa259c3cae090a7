"""Server settings: every server and engine option has a CLEF_* variable, a flag beats its variable, bad
values are named. (Every ``clef serve`` flag, the scale-out ones included, is sampled in
``tests/test_serve_command.py``.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from clef_runtime.options import ENGINE_OPTIONS, MODEL_OPTION, EngineOptions, add_option_arguments
from clef_runtime.server.settings import (
    OPTIONS,
    ServerSettings,
    SettingsError,
    is_loopback,
    parse_bool,
    parse_size,
    server_settings,
    settings_from_namespace,
)


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ServerSettings:
    parser = argparse.ArgumentParser()
    add_option_arguments(parser, (MODEL_OPTION, *ENGINE_OPTIONS, *OPTIONS))
    return settings_from_namespace(parser.parse_args(argv), environ or {})


def test_the_server_settings_hold_no_scale_out_option() -> None:
    fields = set(ServerSettings.__dataclass_fields__)
    assert not {"ray", "replicas", "min_replicas", "max_replicas"} & fields
    assert not [name for name in fields if name.startswith("ray_")]
    assert not [option for option in OPTIONS if option.flag.startswith(("--ray", "--replicas"))]


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


def test_the_default_jobs_database_is_one_per_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    data = tmp_path / "clef-runtime"
    # The default port keeps the file it always had (its queued jobs with it); --port 0 changes every start.
    assert parse(["--model", "m"]).jobs_db_path == data / "jobs.sqlite3"
    assert parse(["--model", "m", "--port", "0"]).jobs_db_path == data / "jobs.sqlite3"
    assert parse(["--model", "m", "--port", "9000"]).jobs_db_path == data / "jobs-9000.sqlite3"
    assert parse(["--model", "m"], {"CLEF_PORT": "9001"}).jobs_db_path == data / "jobs-9001.sqlite3"
    explicit = parse(["--model", "m", "--port", "9000", "--jobs-db", str(tmp_path / "mine.db")])
    assert explicit.jobs_db_path == tmp_path / "mine.db"


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
        ({"CLEF_WEIGHTS": "fp4"}, "CLEF_WEIGHTS"),
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


def test_server_settings_from_python_take_engine_options_by_name() -> None:
    settings = server_settings("tiny", port=9000, cache_mb=64)
    assert (settings.port, settings.engine.cache_mb) == (9000, 64.0)
    with pytest.raises(TypeError):
        server_settings("tiny", replicas=3)  # a scale-out option: clef_runtime.scale.settings


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


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.1.2.3", False),
        ("::ffff:10.1.2.3", False),
        ("clef.internal", False),
        ("localhost.example", False),
    ],
)
def test_only_loopback_addresses_count_as_this_machine_only(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
