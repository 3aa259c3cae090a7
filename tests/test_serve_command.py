"""``clef serve``: every flag (the engine's, the server's and the scale-out ones) has a CLEF_* variable and
lands in its settings object; bad settings exit 2; an address that cannot be bound is one clear line and
exit status 1, before any model loads."""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from devtools.fake_engine import FakeClef

from clef_runtime import cli
from clef_runtime.options import (
    EngineOptions,
    Option,
    parse_bool,
    parse_float,
    parse_int,
    parse_lower,
    parse_size,
)
from clef_runtime.scale import ray_serve
from clef_runtime.scale.settings import RaySettings
from clef_runtime.serve_command import (
    ALL_SERVE_OPTIONS,
    EXIT_CANNOT_LISTEN,
    CannotListenError,
    add_serve_arguments,
    listen,
    run_serve,
    serve,
)
from clef_runtime.server import app as app_module
from clef_runtime.server.settings import ServerSettings, settings_from_namespace
from clef_runtime.server.tracing import check_endpoint

KEY_FILE = str(Path(__file__).parent / "server" / "data" / "api-keys.txt")
"""A key file: the sample of --api-key-file (the settings read it)."""

# A valid non-default value per option: (flag arguments, environment value, expected field value).
SAMPLES: dict[str, tuple[list[str], str, Any]] = {
    "model": (["--model", "tiny"], "tiny", "tiny"),
    "host": (["--host", "0.0.0.0"], "0.0.0.0", "0.0.0.0"),
    "port": (["--port", "9000"], "9000", 9000),
    "api_keys": (["--api-key", "a", "--api-key", "b"], "a, b", ("a", "b")),
    "allow_unauthenticated": (["--allow-unauthenticated"], "1", True),
    "api_key_file": (["--api-key-file", KEY_FILE], KEY_FILE, KEY_FILE),
    "ssl_certfile": (["--ssl-certfile", "/tls/server.crt"], "/tls/server.crt", "/tls/server.crt"),
    "ssl_keyfile": (["--ssl-keyfile", "/tls/server.key"], "/tls/server.key", "/tls/server.key"),
    "ssl_ca_certs": (["--ssl-ca-certs", "/tls/ca.pem"], "/tls/ca.pem", "/tls/ca.pem"),
    "otlp_traces_endpoint": (
        ["--otlp-traces-endpoint", "http://127.0.0.1:4318"],
        "http://127.0.0.1:4318",
        "http://127.0.0.1:4318",
    ),
    "otlp_traces_protocol": (["--otlp-traces-protocol", "grpc"], "grpc", "grpc"),
    "cors_origins": (
        ["--cors-origin", "https://app.example", "--cors-origin", "http://b.example:8080"],
        "https://app.example, http://b.example:8080",
        ("https://app.example", "http://b.example:8080"),
    ),
    "admin_keys": (["--admin-key", "ops:x"], "ops:x", ("ops:x",)),
    "strict_model_names": (["--strict-model-names"], "true", True),
    "max_queue": (["--max-queue", "3"], "3", 3),
    "queue_timeout_ms": (["--queue-timeout-ms", "250"], "250", 250),
    "rate_limit": (["--rate-limit", "2.5"], "2.5", 2.5),
    "rate_burst": (["--rate-burst", "7"], "7", 7),
    "max_step_tokens": (["--max-step-tokens", "999"], "999", 999),
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
    "dtype": (["--dtype", "bf16"], "bf16", "bf16"),
    "weights": (["--weights", "bf16-storage"], "bf16-storage", "bf16-storage"),
    "int8_layers": (["--int8-layers", "1,2"], "1,2", "1,2"),
    "fused_kernels": (["--no-fused-kernels"], "0", False),
    "snapshot_interval": (["--snapshot-interval", "128"], "128", 128),
    "confidence": (["--confidence", "workers-ai"], "workers-ai", "workers-ai"),
    "explain_method": (["--explain-method", "attention"], "attention", "attention"),
    "calibration": (["--calibration", "cal.json"], "cal.json", "cal.json"),
    "head": (["--head", "a=/x", "--head", "/y"], "a=/x,/y", ("a=/x", "/y")),
    "log_requests": (["--log-requests"], "true", True),
    "latency_ms": (["--latency-ms"], "1", True),
    "jobs": (["--jobs", "off"], "off", False),
    "jobs_db": (["--jobs-db", "/tmp/j.sqlite3"], "/tmp/j.sqlite3", "/tmp/j.sqlite3"),
    "jobs_max_lines": (["--jobs-max-lines", "10"], "10", 10),
    "jobs_max_bytes": (["--jobs-max-bytes", "1MiB"], "1MiB", 1024 * 1024),
    "jobs_max_active": (["--jobs-max-active", "2"], "2", 2),
    "jobs_batch_size": (["--jobs-batch-size", "4"], "4", 4),
    "classifiers_db": (["--classifiers-db", "/tmp/c.sqlite3"], "/tmp/c.sqlite3", "/tmp/c.sqlite3"),
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


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser()
    add_serve_arguments(result)
    return result


def value_of(argv: list[str], environ: dict[str, str], field: str) -> Any:
    """A field of the settings ``clef serve`` builds: the server's, the engine's or the scale-out ones."""
    args = parser().parse_args(argv)
    if field in RaySettings.__dataclass_fields__:
        return getattr(RaySettings.from_sources(args, environ), field)
    settings = settings_from_namespace(args, environ)
    return getattr(settings.engine if field in EngineOptions.__dataclass_fields__ else settings, field)


def test_every_option_is_sampled() -> None:
    assert set(SAMPLES) == {option.field for option in ALL_SERVE_OPTIONS}
    assert len(ALL_SERVE_OPTIONS) == len({option.flag for option in ALL_SERVE_OPTIONS})
    assert all(
        option.env == "CLEF_" + option.field.upper()
        or option.field in ("api_keys", "admin_keys", "cors_origins")
        for option in ALL_SERVE_OPTIONS
    )


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_each_option_comes_from_its_flag_or_its_variable(field: str) -> None:
    argv, env_value, expected = SAMPLES[field]
    option = next(o for o in ALL_SERVE_OPTIONS if o.field == field)
    base = [] if field == "model" else ["--model", "m"]
    # --rate-burst alone is refused: it sizes the bucket of a --rate-limit; so are a key or client CAs
    # without a certificate, and another machine's address without an API key.
    with_certificate = (["--ssl-certfile", "/tls/server.crt"], {"CLEF_SSL_CERTFILE": "/tls/server.crt"})
    needs = {
        "rate_burst": (["--rate-limit", "1"], {"CLEF_RATE_LIMIT": "1"}),
        "ssl_keyfile": with_certificate,
        "ssl_ca_certs": with_certificate,
        "host": (["--api-key", "k"], {"CLEF_API_KEY": "k"}),
    }.get(field, ([], {}))
    assert value_of(base + needs[0] + argv, {}, field) == expected
    environ = {option.env: env_value} if field == "model" else {option.env: env_value, "CLEF_MODEL": "m"}
    environ.update(needs[1])
    assert value_of([], environ, field) == expected


@pytest.mark.parametrize(
    ("argv", "environ", "needle"),
    [
        (["--max-queue", "0"], {}, "--max-queue must be at least 1"),
        (["--replicas", "0"], {}, "--replicas and --ray-max-owner-queue must be at least 1"),
        (["--min-replicas", "3", "--max-replicas", "2"], {}, "--max-replicas must be at least 1"),
        (["--max-replicas", "0"], {}, "--max-replicas must be at least 1"),
        ([], {"CLEF_RAY_NUM_CPUS": "many"}, "CLEF_RAY_NUM_CPUS"),
        ([], {"CLEF_RAY_ROUTING": "random"}, "CLEF_RAY_ROUTING"),
        (["--head", "tuned=/nonexistent/head"], {}, "--head tuned=/nonexistent/head: not a directory"),
        (["--head", "a=/x", "--head", "a=/y"], {}, "--head: the name(s) a are given more than once"),
        (["--api-key", "bad name:k1"], {}, "a colon is NAME:KEY, and the name 'bad name' is not"),
        (["--api-key", "a:"], {}, "--api-key a: the key after 'NAME:' is empty"),
        (["--api-key", "alice:k1", "--api-key", "bob:k1"], {}, "--api-key: one key is given under several"),
        (["--api-key", "k1", "--api-key", "k1"], {}, "--api-key: one key is given under several names"),
        (["--rate-burst", "5"], {}, "--rate-burst needs --rate-limit"),
        ([], {"CLEF_RATE_BURST": "5"}, "--rate-burst needs --rate-limit"),
        (["--head", "=/x"], {}, "--head '=/x': the name before '=' is empty"),
        (["--admin-key", "ops:"], {}, "--admin-key ops: the key after 'NAME:' is empty"),
        (
            ["--api-key", "alice:k1", "--admin-key", "ops:k1"],
            {},
            "--admin-key must differ from every --api-key",
        ),
        ([], {"CLEF_API_KEY": "k1", "CLEF_ADMIN_KEY": "k1"}, "--admin-key must differ from every --api-key"),
        (
            ["--host", "0.0.0.0"],
            {},
            "--host 0.0.0.0 serves other machines and no --api-key is set: anyone who can reach the port "
            "could use the server. Set --api-key KEY (CLEF_API_KEY), or pass --allow-unauthenticated",
        ),
        ([], {"CLEF_HOST": "::"}, "--host :: serves other machines and no --api-key is set"),
        (["--host", "clef.internal"], {}, "--host clef.internal serves other machines"),
        (["--host", "0.0.0.0", "--admin-key", "ops:k"], {}, "and no --api-key is set"),
        (["--cors-origin", "https://app.example/"], {}, "(no trailing slash or path"),
        ([], {"CLEF_CORS_ORIGIN": "app.example"}, "--cors-origin 'app.example' is not an origin"),
    ],
)
def test_run_serve_returns_2_on_bad_settings(
    argv: list[str], environ: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_serve(parser().parse_args(["--model", "m", *argv]), environ=environ) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_help_names_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    parser().print_help()
    text = capsys.readouterr().out
    assert all(option.env in text and option.flag in text for option in ALL_SERVE_OPTIONS)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another socket of this process listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


class NeverLoaded(FakeClef):
    def __init__(self) -> None:
        raise AssertionError("the model must not load when the port cannot be bound")


def test_a_port_in_use_is_one_clear_line_and_exit_1(
    taken_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = ServerSettings(model="fake", port=taken_port, jobs=False)
    assert serve(settings, engine_factory=lambda s: NeverLoaded()) == EXIT_CANNOT_LISTEN == 1
    err = capsys.readouterr().err
    assert err == (
        f"clef serve: error: 127.0.0.1:{taken_port} is already in use (another server?): stop it, or choose "
        "another --port\n"
    )


@pytest.mark.parametrize("ray", [False, True], ids=["plain", "ray"])
def test_clef_serve_checks_the_port_before_starting_anything(
    taken_port: int, ray: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # With --ray too: Ray Serve's proxy would only find out after Ray and the replicas started.
    started: list[str] = []

    def never(what: str) -> Callable[..., Any]:
        def refuse(*args: Any) -> Any:
            started.append(what)
            raise AssertionError(f"{what} must not start when the port cannot be bound")

        return refuse

    # Stand-ins that fail loudly: a regression must not load the model or leave a Ray cluster running.
    monkeypatch.setattr(app_module, "load_clef", never("the model"))
    monkeypatch.setattr(ray_serve, "run_ray_serve", never("Ray Serve"))
    argv = ["--model", "tiny", "--port", str(taken_port), *(["--ray"] if ray else [])]
    assert run_serve(parser().parse_args(argv), environ={}) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{taken_port} is already in use" in err and "--port" in err and "Errno" not in err
    assert started == []


def test_two_servers_cannot_both_take_one_port() -> None:
    # Both sockets set SO_REUSEADDR: on Linux the second bind succeeds unless the first already listens.
    with listen("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        with pytest.raises(CannotListenError, match=f"127.0.0.1:{port} is already in use"):
            listen("127.0.0.1", port).close()


def test_serve_closes_its_socket_when_the_app_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no app")

    monkeypatch.setattr(app_module, "create_app", broken)
    sock = listen("127.0.0.1", 0)
    settings = ServerSettings(model="fake", port=sock.getsockname()[1], jobs=False)
    with pytest.raises(RuntimeError, match="no app"):
        serve(settings, engine_factory=lambda s: NeverLoaded(), sock=sock)
    assert sock.fileno() == -1


def test_an_address_of_another_machine_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    settings = ServerSettings(
        model="fake", host="192.0.2.1", port=8094, jobs=False, api_keys=("k",)
    )  # TEST-NET-1
    assert serve(settings, engine_factory=lambda s: NeverLoaded()) == 1
    err = capsys.readouterr().err
    assert err.startswith("clef serve: error: cannot listen on 192.0.2.1:8094: ") and "--host" in err


@pytest.mark.parametrize("jobs", [True, False], ids=["jobs-on", "jobs-off"])
def test_the_startup_log_names_the_jobs_and_classifiers_databases(
    jobs: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import uvicorn

    # Everything up to serving: the app opens its databases and the command logs, then no request is served.
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    sock = listen("127.0.0.1", 0)
    settings = ServerSettings(model="fake", port=sock.getsockname()[1], jobs=jobs)
    with caplog.at_level(logging.INFO):
        serve(settings, engine_factory=lambda s: FakeClef(), sock=sock)
    assert f"saved classifiers stored in {settings.classifiers_db_path}" in caplog.text
    jobs_lines = [line for line in caplog.messages if "batch jobs" in line]
    if jobs:
        assert len(jobs_lines) == 1 and jobs_lines[0].endswith(f"stored in {settings.jobs_db_path}")
    else:
        assert jobs_lines == ["batch jobs are off (--jobs off)"]


# Every option whose value is parsed (not free text, not a switch): "x" is a value each of them refuses.
PARSED_OPTIONS = [
    option for option in ALL_SERVE_OPTIONS if option.kind == "value" and option.parse is not str
]


def test_the_parsed_options_cover_every_parser() -> None:
    parsers = {parse_int, parse_float, parse_size, parse_bool, parse_lower, str.strip, float, check_endpoint}
    assert {option.parse for option in PARSED_OPTIONS} == parsers


@pytest.mark.parametrize("option", PARSED_OPTIONS, ids=lambda option: option.flag)
def test_a_bad_value_names_its_flag_and_what_it_expects_not_our_parser(
    option: Option, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["serve", "--model", "m", option.flag, "x"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("clef serve: error: ") and option.flag in error and "'x'" in error
    assert "parse_" not in error and "invalid parse" not in error
    if option.parse in (parse_int, parse_float, parse_size, parse_bool):  # ours say what they expect
        assert "(e.g. " in error or "(use " in error


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--host", "0.0.0.0", "--api-key", "k"], {}),
        (["--host", "0.0.0.0", "--allow-unauthenticated"], {}),
        (["--host", "0.0.0.0", "--api-key-file", KEY_FILE], {}),
        ([], {"CLEF_HOST": "0.0.0.0", "CLEF_ALLOW_UNAUTHENTICATED": "1"}),
        (["--host", "127.0.0.2"], {}),
        (["--host", "::1"], {}),
        (["--host", "localhost"], {}),
        (["--host", "::ffff:127.0.0.1"], {}),
    ],
)
def test_another_machines_address_is_served_with_a_key_or_when_allowed(
    argv: list[str], environ: dict[str, str]
) -> None:
    # Negative control of the refusals above: the same addresses with a key, or allowed, or loopback.
    assert settings_from_namespace(parser().parse_args(["--model", "m", *argv]), environ).model == "m"
