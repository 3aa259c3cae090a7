"""The server's configuration: one :class:`ServerSettings` object, built from CLI flags and ``CLEF_*``
environment variables (a flag beats its variable, the variable beats the default).

The engine's options (device, weights, cache, images, ...) are `clef_runtime.options.EngineOptions`,
nested as ``settings.engine``; this module adds the server's own (HTTP, auth, batching, jobs, logging) in
:data:`OPTIONS`. Both tables generate the CLI flags and the variables, so a flag can never lack its variable.
The scale-out options (``--ray``, ``--replicas``, ...) are ``clef_runtime.scale.settings``'s, and the
``clef serve`` command (``clef_runtime.serve_command``) puts the three tables together.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from clef_runtime.engine.policy import DEFAULT_STEP_ROWS
from clef_runtime.options import (
    MODEL_OPTION,
    EngineOptions,
    Option,
    OptionsError,
    parse_bool,
    parse_float,
    parse_int,
    parse_lower,
    parse_size,
    read_option_values,
)
from clef_runtime.server.auth import parse_key
from clef_runtime.server.tracing import PROTOCOLS, check_endpoint, exporters_installed, missing_extra_message

__all__ = [
    "DEFAULT_PORT",
    "OPTIONS",
    "Option",
    "ServerSettings",
    "SettingsError",
    "data_dir",
    "is_loopback",
    "parse_bool",
    "parse_size",
    "read_key_file",
    "server_settings",
    "settings_from_namespace",
]

MiB = 1024 * 1024


SettingsError = OptionsError
"""An option has an invalid value; the message names the flag and its environment variable."""


DEFAULT_PORT = 8094


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: ``localhost`` or a loopback address (127.0.0.0/8,
    ``::1``, an IPv4-mapped loopback). A host name other than ``localhost`` is not: it may resolve to any
    address, and the empty host binds every interface."""
    name = host.strip().strip("[]").lower()
    if name in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback


_ORIGIN = re.compile(r"^https?://[^/?#\s@]+$")


def data_dir() -> Path:
    """The user data directory of clef-runtime's databases: ``$XDG_DATA_HOME/clef-runtime``
    (``~/.local/share/clef-runtime`` without the variable)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "clef-runtime"


@dataclass(frozen=True)
class ServerSettings:
    """Everything ``clef serve`` can be told. Immutable; build a new one to change it."""

    model: str
    """``tiny``, a local release directory, or a Hugging Face repo id with an optional ``@revision``."""
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_keys: tuple[str, ...] = ()
    """Accepted keys (``NAME:KEY`` names one; see `clef_runtime.server.auth`); empty means auth is off."""
    api_key_file: str | None = None
    """A file of API keys (a mounted secret), one per line; read when the settings are built, its keys join
    ``api_keys`` in `accepted_api_keys`."""
    allow_unauthenticated: bool = False
    """Serve a non-loopback ``host`` without an API key (something in front authenticates); without it
    such settings are refused."""
    ssl_certfile: str | None = None
    """The server's certificate chain (PEM): with it the server speaks HTTPS only."""
    ssl_keyfile: str | None = None
    """The certificate's private key (PEM); None: it is in ``ssl_certfile``."""
    ssl_ca_certs: str | None = None
    """CA certificates (PEM) that client certificates must chain to: with it every client must present one
    (mutual TLS)."""
    cors_origins: tuple[str, ...] = ()
    """Browser origins (``https://app.example``, or ``*``) whose pages may call the API; empty: none but the
    server's own pages (same origin needs no CORS)."""
    rate_limit: float | None = None
    """Decision requests per second per API key (per client address with auth off); None: no limit."""
    rate_burst: int | None = None
    """Requests a caller may make at once before the rate applies; None: the rate rounded up (at least 1)."""
    max_queue: int = 256
    """Requests that may wait for the engine; one more gets 429."""
    queue_timeout_ms: int | None = None
    """How long a request may wait for the engine without starting; then 503 with Retry-After (None: no
    bound). Batch-job lines are exempt: they wait in their own lane."""
    max_batch_size: int = DEFAULT_STEP_ROWS
    """Requests computed together in one engine step."""
    max_input_tokens: int | None = None
    """Input-token limit per request; None means ``max_length``."""
    max_body_bytes: int = 16 * MiB
    """Request body limit, before and after decompression (16 MiB: four 4 MiB images in base64 fit)."""
    deterministic: bool = False
    """Run every request alone in arrival order so repeated requests give identical bytes."""
    on_overflow: Literal["truncate", "reject"] = "truncate"
    log_requests: bool = False
    latency_ms: bool = False
    """Also put the server time in a top-level ``latency_ms`` (what systemone-client and Krite read)."""
    log_level: str = "info"
    jobs: bool = True
    """Serve the batch-job routes (/v1/jobs)."""
    jobs_db: str | None = None
    """The jobs database (SQLite); None: one per port in the user data directory (`jobs_db_path`)."""
    jobs_max_lines: int = 100_000
    """Lines per job."""
    jobs_max_bytes: int = 256 * MiB
    """Bytes per job body (compressed and decompressed)."""
    jobs_max_active: int = 16
    """Queued or running jobs per API key (all callers share one with auth off)."""
    jobs_batch_size: int = 1
    """Job lines started per engine step; an interactive request arriving meanwhile waits for at most one
    step."""
    admin_keys: tuple[str, ...] = ()
    """Keys of the admin routes (``POST`` / ``DELETE /v1/heads``), ``NAME:KEY`` or ``KEY``; empty: those
    routes are not served (404)."""
    strict_model_names: bool = False
    """Refuse (404) a request whose ``model`` names no served head, instead of answering it with the default
    head (what SDKs sending ``jev-latest`` or an OpenAI model name need)."""
    classifiers_db: str | None = None
    """The saved classifiers' database (SQLite); None: ``classifiers.sqlite3`` in the user data directory,
    whatever ``jobs_db`` says."""
    otlp_traces_endpoint: str | None = None
    """Where OpenTelemetry traces go (OTLP); None: the standard ``OTEL_EXPORTER_OTLP_*`` variables decide
    (`clef_runtime.server.tracing`), off without them."""
    otlp_traces_protocol: str | None = None
    """``http/protobuf`` or ``grpc``; None: ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL``, else http/protobuf."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """The engine's options (``Clef.load``); its ``max_length`` is the encoder's maximum sequence length."""
    file_api_keys: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    """The keys read from ``api_key_file`` (set by the settings themselves)."""

    def __post_init__(self) -> None:
        problems = []
        if self.api_key_file is not None:
            try:
                object.__setattr__(self, "file_api_keys", read_key_file(self.api_key_file))
            except ValueError as exc:
                problems.append(str(exc))
        if not self.model:
            problems.append("--model is required (or set CLEF_MODEL)")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port must be 0..65535, got {self.port}")
        for name in (
            "max_queue",
            "max_batch_size",
            "max_body_bytes",
            "jobs_max_lines",
            "jobs_max_bytes",
            "jobs_max_active",
            "jobs_batch_size",
        ):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.rate_limit is not None and not (0 < self.rate_limit < float("inf")):
            problems.append(f"--rate-limit must be a positive number (requests/s), got {self.rate_limit}")
        if self.rate_burst is not None and self.rate_burst < 1:
            problems.append(f"--rate-burst must be at least 1, got {self.rate_burst}")
        if self.rate_burst is not None and self.rate_limit is None:
            # A burst alone would be silently ignored: there is no bucket without a rate.
            problems.append("--rate-burst needs --rate-limit (the burst is the size of the rate's bucket)")
        problems.extend(_key_problems(self.accepted_api_keys))
        problems.extend(_key_problems(self.admin_keys, "--admin-key"))
        if self.queue_timeout_ms is not None and self.queue_timeout_ms < 1:
            problems.append(f"--queue-timeout-ms must be at least 1, got {self.queue_timeout_ms}")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            problems.append(f"--max-input-tokens must be at least 1, got {self.max_input_tokens}")
        if self.on_overflow not in ("truncate", "reject"):
            problems.append(f"--on-overflow must be 'truncate' or 'reject', got {self.on_overflow!r}")
        if any(not key or not key.isprintable() or key != key.strip() for key in self.accepted_api_keys):
            problems.append("--api-key values must be non-empty printable strings without surrounding spaces")
        if any(not key or not key.isprintable() or key != key.strip() for key in self.admin_keys):
            problems.append(
                "--admin-key values must be non-empty printable strings without surrounding spaces"
            )
        if _shared_secrets(self.accepted_api_keys, self.admin_keys):
            problems.append(
                "--admin-key must differ from every --api-key (an API key must not unlock the admin routes)"
            )
        problems.extend(self._network_problems())
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            problems.append(f"--log-level must be critical/error/warning/info/debug, got {self.log_level!r}")
        problems.extend(self._tracing_problems())
        if problems:
            raise SettingsError("; ".join(problems))

    def _network_problems(self) -> list[str]:
        """What is wrong with the address, TLS and CORS settings (the files themselves are read at start:
        `clef_runtime.server.tls`)."""
        problems = []
        if not self.accepted_api_keys and not self.allow_unauthenticated and not is_loopback(self.host):
            shown = self.host or "''"
            problems.append(
                f"--host {shown} serves other machines and no --api-key is set: anyone who can "
                "reach the port could use the server. Set --api-key KEY (CLEF_API_KEY), or pass "
                "--allow-unauthenticated (CLEF_ALLOW_UNAUTHENTICATED=1) when something in front "
                "authenticates (a proxy, a private network)"
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            problems.append("--ssl-keyfile needs --ssl-certfile (the certificate the key belongs to)")
        if self.ssl_ca_certs and not self.ssl_certfile:
            problems.append("--ssl-ca-certs (client certificates) needs --ssl-certfile (the server's own)")
        for origin in self.cors_origins:
            if origin != "*" and not _ORIGIN.match(origin):
                hint = (
                    " (no trailing slash or path: browsers send scheme://host[:port])"
                    if "://" in origin
                    else ""
                )
                problems.append(
                    f"--cors-origin {origin!r} is not an origin: use scheme://host[:port], e.g. "
                    f"https://app.example.com, or *{hint}"
                )
        return problems

    def _tracing_problems(self) -> list[str]:
        """A bad ``--otlp-traces-endpoint`` or protocol, or tracing asked for without the ``otel`` extra."""
        if self.otlp_traces_protocol is not None and self.otlp_traces_protocol not in PROTOCOLS:
            return [
                f"--otlp-traces-protocol must be {' or '.join(PROTOCOLS)}, got {self.otlp_traces_protocol!r}"
            ]
        if self.otlp_traces_endpoint is None:
            return []
        try:
            check_endpoint(self.otlp_traces_endpoint)
        except ValueError as exc:
            return [f"--otlp-traces-endpoint: {exc}"]
        if not exporters_installed(self.otlp_traces_protocol or "http/protobuf"):
            return [missing_extra_message()]
        return []

    @property
    def max_length(self) -> int:
        """The encoder's maximum sequence length (``engine.max_length``)."""
        return self.engine.max_length

    @property
    def input_token_limit(self) -> int:
        """The effective per-request input limit: ``min(max_length, max_input_tokens)``."""
        if self.max_input_tokens is None:
            return self.max_length
        return min(self.max_length, self.max_input_tokens)

    @property
    def jobs_db_path(self) -> Path:
        """Where the jobs database lives: ``--jobs-db``, else in `data_dir`: ``jobs.sqlite3`` for the default
        port (and for ``--port 0``, whose port changes every start), ``jobs-<port>.sqlite3`` for any other,
        so servers on different ports each own a database of their own with the default options."""
        if self.jobs_db:
            return Path(self.jobs_db).expanduser()
        own_port = self.port not in (DEFAULT_PORT, 0)
        return data_dir() / (f"jobs-{self.port}.sqlite3" if own_port else "jobs.sqlite3")

    @property
    def classifiers_db_path(self) -> Path:
        """Where the saved classifiers live: ``--classifiers-db``, else ``classifiers.sqlite3`` in `data_dir`,
        one file every server of this user shares (classifiers are definitions, not work: the store takes no
        lock), wherever its jobs database is."""
        if self.classifiers_db:
            return Path(self.classifiers_db).expanduser()
        return data_dir() / "classifiers.sqlite3"

    @property
    def former_classifiers_db_path(self) -> Path | None:
        """Where releases before the shared default kept this server's saved classifiers, when that is
        not `classifiers_db_path`: ``classifiers.sqlite3`` beside an explicit ``--jobs-db`` (None with
        ``--classifiers-db`` or without ``--jobs-db``)."""
        if self.classifiers_db or not self.jobs_db:
            return None
        former = self.jobs_db_path.with_name("classifiers.sqlite3")
        return None if former.resolve() == self.classifiers_db_path.resolve() else former

    @property
    def queue_timeout_s(self) -> float | None:
        """``queue_timeout_ms`` in seconds (None: no bound)."""
        return None if self.queue_timeout_ms is None else self.queue_timeout_ms / 1000

    @property
    def rate_burst_size(self) -> int:
        """The effective burst: ``rate_burst``, else the rate rounded up (at least 1)."""
        if self.rate_burst is not None:
            return self.rate_burst
        return max(1, math.ceil(self.rate_limit or 1))

    @property
    def tls_enabled(self) -> bool:
        """True when the server speaks HTTPS (``ssl_certfile`` is set)."""
        return bool(self.ssl_certfile)

    @property
    def auth_enabled(self) -> bool:
        """True when at least one API key is configured."""
        return bool(self.accepted_api_keys)

    @property
    def accepted_api_keys(self) -> tuple[str, ...]:
        """Every API key the server accepts: ``api_keys``, then those of ``api_key_file``."""
        return self.api_keys + self.file_api_keys

    def engine_options(self) -> EngineOptions:
        """The options ``Clef.load`` gets: ``engine`` with ``max_length`` lowered to the input limit."""
        return self.engine.replace(max_length=self.input_token_limit)

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict for logs, with API and admin keys replaced by their count."""
        out = dataclasses.asdict(self)
        out["api_keys"] = f"<{len(self.api_keys)} key(s)>"
        out["file_api_keys"] = f"<{len(self.file_api_keys)} key(s)>"
        out["admin_keys"] = f"<{len(self.admin_keys)} key(s)>"
        return out


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of an ``--api-key-file``: one per line (``NAME:KEY`` or a bare key), surrounding spaces,
    blank lines and ``#`` comment lines left out. Raises ValueError naming the flag and the file when it
    cannot be read or holds no key: an empty secret must not turn auth off."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"--api-key-file {path}: cannot be read ({reason})") from None
    keys = tuple(
        line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key (one per line, NAME:KEY or KEY)")
    return keys


def _key_problems(values: tuple[str, ...], flag: str = "--api-key") -> list[str]:
    """What is wrong with the configured ``--api-key`` (or ``--admin-key``) values (never quoting a key): a
    malformed ``NAME:KEY``, a name given twice, or one key given twice (under two names, whichever would
    match)."""
    problems = []
    keys = []
    for position, value in enumerate(values, 1):
        try:
            keys.append(parse_key(value, position))
        except ValueError as exc:
            problems.append(str(exc).replace("--api-key", flag))
    names = [key.name for key in keys]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"{flag} names must be unique, repeated: {', '.join(duplicates)}")
    by_secret: dict[str, list[str]] = {}
    for key in keys:
        by_secret.setdefault(key.secret, []).append(key.name)
    for sharing in by_secret.values():
        if len(sharing) > 1:  # a request with that key could only ever be counted under one of the names
            problems.append(f"{flag}: one key is given under several names: {', '.join(sharing)}")
    return problems


def _shared_secrets(api_keys: tuple[str, ...], admin_keys: tuple[str, ...]) -> bool:
    """Whether an admin key is also an API key (malformed values are reported by `_key_problems`)."""

    def secrets(values: tuple[str, ...]) -> set[str]:
        found = set()
        for position, value in enumerate(values, 1):
            try:
                found.add(parse_key(value, position).secret)
            except ValueError:
                continue
        return found

    return bool(secrets(api_keys) & secrets(admin_keys))


OPTIONS: tuple[Option, ...] = (
    Option(
        "host", "--host", "CLEF_HOST", str, "address to bind (default 127.0.0.1: this machine only)", "ADDR"
    ),
    Option("port", "--port", "CLEF_PORT", parse_int, "TCP port (default 8094)", "N"),
    Option(
        "api_keys",
        "--api-key",
        "CLEF_API_KEY",
        str,
        "require this API key (repeatable; the variable takes a comma-separated list); NAME:KEY names it "
        "for --rate-limit, /metrics and logs (else key-1, key-2, ...); read from 'Authorization: Bearer' "
        "or 'X-API-Key'. Default: auth off",
        "KEY",
        kind="append",
    ),
    Option(
        "api_key_file",
        "--api-key-file",
        "CLEF_API_KEY_FILE",
        str,
        "also require the API keys of this file, one per line (NAME:KEY or KEY; # comments): a mounted "
        "secret, kept out of the environment and the command line. An empty file is an error",
        "PATH",
    ),
    Option(
        "allow_unauthenticated",
        "--allow-unauthenticated",
        "CLEF_ALLOW_UNAUTHENTICATED",
        parse_bool,
        "serve a --host other than loopback without --api-key (something in front authenticates); without "
        "it such a server refuses to start",
        kind="bool",
    ),
    Option(
        "ssl_certfile",
        "--ssl-certfile",
        "CLEF_SSL_CERTFILE",
        str,
        "serve HTTPS with this certificate chain (PEM); TLS 1.2 or later",
        "PATH",
    ),
    Option(
        "ssl_keyfile",
        "--ssl-keyfile",
        "CLEF_SSL_KEYFILE",
        str,
        "the certificate's private key (PEM; default: inside --ssl-certfile)",
        "PATH",
    ),
    Option(
        "ssl_ca_certs",
        "--ssl-ca-certs",
        "CLEF_SSL_CA_CERTS",
        str,
        "require a client certificate issued by these CAs (PEM): mutual TLS (default: none asked)",
        "PATH",
    ),
    Option(
        "cors_origins",
        "--cors-origin",
        "CLEF_CORS_ORIGIN",
        str,
        "let pages of this browser origin (scheme://host[:port], or *) call the API (repeatable; the "
        "variable takes a comma-separated list). Default: none; the server's own pages always work",
        "ORIGIN",
        kind="append",
    ),
    Option(
        "rate_limit",
        "--rate-limit",
        "CLEF_RATE_LIMIT",
        parse_float,
        "decision requests per second per API key (per client address with auth off); beyond it 429 with "
        "Retry-After and X-RateLimit-* headers (default: no limit)",
        "RPS",
    ),
    Option(
        "rate_burst",
        "--rate-burst",
        "CLEF_RATE_BURST",
        parse_int,
        "requests a caller may make at once before --rate-limit applies (default: the rate, rounded up)",
        "N",
    ),
    Option(
        "max_queue",
        "--max-queue",
        "CLEF_MAX_QUEUE",
        parse_int,
        "requests that may wait for the engine; beyond it 429 with Retry-After (default 256)",
        "N",
    ),
    Option(
        "queue_timeout_ms",
        "--queue-timeout-ms",
        "CLEF_QUEUE_TIMEOUT_MS",
        parse_int,
        "a request that has waited this long without starting gets 503 with Retry-After and is never "
        "computed (default: no bound; batch-job lines are exempt)",
        "N",
    ),
    Option(
        "max_batch_size",
        "--max-batch-size",
        "CLEF_MAX_BATCH_SIZE",
        parse_int,
        f"requests computed together in one engine step (default {DEFAULT_STEP_ROWS}; the step's tokens are "
        "--max-step-tokens)",
        "N",
    ),
    Option(
        "max_input_tokens",
        "--max-input-tokens",
        "CLEF_MAX_INPUT_TOKENS",
        parse_int,
        "input tokens per request (default: --max-length); see --on-overflow",
        "N",
    ),
    Option(
        "max_body_bytes",
        "--max-body-bytes",
        "CLEF_MAX_BODY_BYTES",
        parse_size,
        "request body limit, compressed and decompressed, e.g. 8MiB (default 16MiB); beyond it 413",
        "N",
    ),
    Option(
        "deterministic",
        "--deterministic",
        "CLEF_DETERMINISTIC",
        parse_bool,
        "run each request alone in arrival order, in chunks of --max-step-tokens: identical requests give "
        "identical bytes (no batching, no overtaking: lower throughput and latency under concurrency)",
        kind="bool",
    ),
    Option(
        "on_overflow",
        "--on-overflow",
        "CLEF_ON_OVERFLOW",
        str,
        "input over the token limit: 'truncate' cuts the state's tail and reports the cut in "
        "x_truncated_state_tokens (default, as the reference); 'reject' answers 413",
        "MODE",
        choices=("truncate", "reject"),
    ),
    Option(
        "jobs",
        "--jobs",
        "CLEF_JOBS",
        parse_bool,
        "serve the durable batch-job routes /v1/jobs: on (default) or off",
        "on|off",
    ),
    Option(
        "jobs_db",
        "--jobs-db",
        "CLEF_JOBS_DB",
        str,
        "the jobs database file (SQLite), owned by one server: default jobs.sqlite3 in "
        "$XDG_DATA_HOME/clef-runtime for --port 8094, jobs-PORT.sqlite3 there for another port (a default "
        "one another server holds turns jobs off with a warning)",
        "PATH",
    ),
    Option(
        "jobs_max_lines",
        "--jobs-max-lines",
        "CLEF_JOBS_MAX_LINES",
        parse_int,
        "lines per batch job (default 100000)",
        "N",
    ),
    Option(
        "jobs_max_bytes",
        "--jobs-max-bytes",
        "CLEF_JOBS_MAX_BYTES",
        parse_size,
        "bytes per batch-job body, compressed and decompressed (default 256MiB)",
        "N",
    ),
    Option(
        "jobs_max_active",
        "--jobs-max-active",
        "CLEF_JOBS_MAX_ACTIVE",
        parse_int,
        "queued or running jobs per API key and model (default 16); one more new job gets 429",
        "N",
    ),
    Option(
        "jobs_batch_size",
        "--jobs-batch-size",
        "CLEF_JOBS_BATCH_SIZE",
        parse_int,
        "job lines started per engine step, only when no interactive request waits or runs (default 1: "
        "an interactive request arriving meanwhile waits for at most one step; more raise job throughput)",
        "N",
    ),
    Option(
        "classifiers_db",
        "--classifiers-db",
        "CLEF_CLASSIFIERS_DB",
        str,
        "the saved classifiers' database file (SQLite; default classifiers.sqlite3 in "
        "$XDG_DATA_HOME/clef-runtime, whatever --jobs-db is; servers may share one)",
        "PATH",
    ),
    Option(
        "admin_keys",
        "--admin-key",
        "CLEF_ADMIN_KEY",
        str,
        "the key of the admin routes, POST and DELETE /v1/heads (load and unload heads at run time); "
        "NAME:KEY names it; repeatable (the variable takes a comma-separated list). An --api-key gets 403 "
        "there. Default: none, and those routes are not served",
        "KEY",
        kind="append",
    ),
    Option(
        "strict_model_names",
        "--strict-model-names",
        "CLEF_STRICT_MODEL_NAMES",
        parse_bool,
        "refuse (404, listing the served names) a request whose model names no served head; by default it is "
        "answered by the default head, as SDKs that send jev-latest or an OpenAI model name need",
        kind="bool",
    ),
    Option(
        "log_requests",
        "--log-requests",
        "CLEF_LOG_REQUESTS",
        parse_bool,
        "also log request bodies (never logged otherwise)",
        kind="bool",
    ),
    Option(
        "latency_ms",
        "--latency-ms",
        "CLEF_LATENCY_MS",
        parse_bool,
        "also report the server time as a top-level latency_ms in responses, where "
        "systemone-client reads it (off by default: jevcompat wants extra fields x_-prefixed)",
        kind="bool",
    ),
    Option(
        "otlp_traces_endpoint",
        "--otlp-traces-endpoint",
        "CLEF_OTLP_TRACES_ENDPOINT",
        check_endpoint,
        "send OpenTelemetry traces (a span per request, children for body read, encode, queue, steps and "
        "head) to this OTLP endpoint, e.g. http://127.0.0.1:4318 (a URL without a path gets /v1/traces); the "
        "standard OTEL_EXPORTER_OTLP_* variables also turn it on (needs the 'otel' extra; default off)",
        "URL",
    ),
    Option(
        "otlp_traces_protocol",
        "--otlp-traces-protocol",
        "CLEF_OTLP_TRACES_PROTOCOL",
        parse_lower,
        "OTLP transport of the traces: http/protobuf or grpc (default: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or "
        "OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf)",
        "PROTO",
    ),
    Option(
        "log_level",
        "--log-level",
        "CLEF_LOG_LEVEL",
        parse_lower,
        "critical, error, warning, info (default) or debug",
        "LEVEL",
    ),
)


def settings_from_namespace(args: argparse.Namespace | None, environ: Mapping[str, str]) -> ServerSettings:
    """Build settings from parsed CLI flags, falling back to ``CLEF_*`` variables in ``environ``.

    Returns the settings. Raises :class:`SettingsError` naming the flag/variable of any invalid value.
    """
    values = read_option_values(args, environ, (MODEL_OPTION, *OPTIONS))
    if "model" not in values:
        raise SettingsError("--model is required (or set CLEF_MODEL): 'tiny', a directory or a repo id")
    engine = EngineOptions.from_sources(args, environ)
    return ServerSettings(**values, engine=engine)


def server_settings(model: str, engine: EngineOptions | None = None, **values: Any) -> ServerSettings:
    """Settings from Python: server fields by name, engine fields by name too (collected into ``engine``).

    Raises :class:`SettingsError` for a bad value, TypeError for an unknown name."""
    engine_fields = {f.name for f in dataclasses.fields(EngineOptions)}
    engine_values = {k: values.pop(k) for k in list(values) if k in engine_fields}
    base = engine or EngineOptions()
    return ServerSettings(model=model, engine=base.replace(**engine_values), **values)
