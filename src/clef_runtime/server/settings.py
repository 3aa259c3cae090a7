"""The server's configuration: one :class:`ServerSettings` object, built from CLI flags and ``CLEF_*``
environment variables (a flag beats its variable, the variable beats the default).

Every option is declared once in :data:`OPTIONS`; the CLI parser and the environment reader are both
generated from that table, so a flag can never lack its variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "OPTIONS",
    "Option",
    "ServerSettings",
    "SettingsError",
    "parse_bool",
    "parse_size",
    "settings_from_namespace",
]

MiB = 1024 * 1024


class SettingsError(ValueError):
    """An option has an invalid value; the message names the flag and its environment variable."""


@dataclass(frozen=True)
class ServerSettings:
    """Everything ``clef serve`` can be told. Immutable; build a new one to change it."""

    model: str
    """``tiny``, a local release directory, or a Hugging Face repo id with an optional ``@revision``."""
    host: str = "127.0.0.1"
    port: int = 8094
    api_keys: tuple[str, ...] = ()
    """Accepted keys; empty means auth is off."""
    max_queue: int = 256
    """Requests that may wait for the engine; one more gets 429."""
    max_batch_tokens: int = 16384
    """Padded tokens (longest request x batch size) per engine call."""
    max_batch_size: int = 32
    max_input_tokens: int | None = None
    """Input-token limit per request; None means ``max_length``."""
    max_body_bytes: int = 16 * MiB
    """Request body limit, before and after decompression (16 MiB: four 4 MiB images in base64 fit)."""
    deterministic: bool = False
    """Run every request alone in arrival order so repeated requests give identical bytes."""
    device: str | None = None
    prefill_chunk: int | None = None
    max_length: int = 16384
    """The encoder's maximum sequence length (the reference's ``max_length``)."""
    on_overflow: Literal["truncate", "reject"] = "truncate"
    cache_mb: float | None = None
    """State-cache budget in MiB; None: the engine's default, 0: off."""
    image_mode: str | None = None
    image_max_tokens: int | None = None
    batch_window_ms: float = 5.0
    log_requests: bool = False
    log_level: str = "info"
    extra_engine_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to ``Clef.load`` as is (Python API only)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.model:
            problems.append("--model is required (or set CLEF_MODEL)")
        if not 0 <= self.port <= 65535:
            problems.append(f"--port must be 0..65535, got {self.port}")
        for name in ("max_queue", "max_batch_tokens", "max_batch_size", "max_body_bytes", "max_length"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_input_tokens is not None and self.max_input_tokens < 1:
            problems.append(f"--max-input-tokens must be at least 1, got {self.max_input_tokens}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            problems.append(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if self.cache_mb is not None and self.cache_mb < 0:
            problems.append(f"--cache-mb must be >= 0, got {self.cache_mb}")
        if self.image_max_tokens is not None and self.image_max_tokens < 1:
            problems.append(f"--image-max-tokens must be at least 1, got {self.image_max_tokens}")
        if self.on_overflow not in ("truncate", "reject"):
            problems.append(f"--on-overflow must be 'truncate' or 'reject', got {self.on_overflow!r}")
        if self.batch_window_ms < 0:
            problems.append(f"--batch-window-ms must be >= 0, got {self.batch_window_ms}")
        if any(not key or not key.isprintable() or key != key.strip() for key in self.api_keys):
            problems.append("--api-key values must be non-empty printable strings without surrounding spaces")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            problems.append(f"--log-level must be critical/error/warning/info/debug, got {self.log_level!r}")
        if problems:
            raise SettingsError("; ".join(problems))

    @property
    def input_token_limit(self) -> int:
        """The effective per-request input limit: ``min(max_length, max_input_tokens)``."""
        if self.max_input_tokens is None:
            return self.max_length
        return min(self.max_length, self.max_input_tokens)

    @property
    def auth_enabled(self) -> bool:
        """True when at least one API key is configured."""
        return bool(self.api_keys)

    def engine_options(self) -> dict[str, Any]:
        """Keyword options for ``Clef.load``: only those set, so the engine keeps its own defaults."""
        options: dict[str, Any] = {"max_length": self.input_token_limit}
        if self.device is not None:
            options["device"] = self.device
        if self.prefill_chunk is not None:
            options["prefill_chunk"] = self.prefill_chunk
        if self.cache_mb is not None:
            options["cache_mb"] = self.cache_mb
        if self.image_mode is not None:
            options["image_mode"] = self.image_mode
        if self.image_max_tokens is not None:
            options["image_max_tokens"] = self.image_max_tokens
        options.update(self.extra_engine_options)
        return options

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict for logs, with API keys replaced by their count."""
        out = dataclasses.asdict(self)
        out["api_keys"] = f"<{len(self.api_keys)} key(s)>"
        return out


# ---------------------------------------------------------------------------------------------- parsing


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off/""`` -> False. Raises ``ValueError`` otherwise."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use 1/0, true/false, yes/no, on/off)")


_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``8388608``, ``512k``, ``8M``, ``8MiB``, ``1G`` (suffixes are powers of 1024).

    Raises ``ValueError`` on anything else."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 8388608, 512k, 8MiB)")
    number, unit = int(match.group(1)), match.group(2).lower()
    return number * {"": 1, "k": 1024, "m": MiB, "g": 1024 * MiB}[unit]


def _positive_int(text: str) -> int:
    return int(text.strip())


def _api_keys(text: str) -> tuple[str, ...]:
    return tuple(key.strip() for key in text.split(",") if key.strip())


@dataclass(frozen=True)
class Option:
    """One setting: its field, flag, environment variable, parser and help text."""

    field: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    help: str
    metavar: str | None = None
    kind: Literal["value", "bool", "append"] = "value"
    choices: tuple[str, ...] | None = None


OPTIONS: tuple[Option, ...] = (
    Option(
        "model",
        "--model",
        "CLEF_MODEL",
        str,
        "model to serve: 'tiny' (built-in untrained test model), a local release directory, or a Hugging "
        "Face repo id with an optional @revision (e.g. Cloudflare/clef-flash)",
        "M",
    ),
    Option(
        "host", "--host", "CLEF_HOST", str, "address to bind (default 127.0.0.1: this machine only)", "ADDR"
    ),
    Option("port", "--port", "CLEF_PORT", _positive_int, "TCP port (default 8094)", "N"),
    Option(
        "api_keys",
        "--api-key",
        "CLEF_API_KEY",
        str,
        "require this API key (repeatable; the variable takes a comma-separated list); read from "
        "'Authorization: Bearer' or 'X-API-Key'. Default: auth off",
        "KEY",
        kind="append",
    ),
    Option(
        "max_queue",
        "--max-queue",
        "CLEF_MAX_QUEUE",
        _positive_int,
        "requests that may wait for the engine; beyond it 429 with Retry-After (default 256)",
        "N",
    ),
    Option(
        "max_batch_tokens",
        "--max-batch-tokens",
        "CLEF_MAX_BATCH_TOKENS",
        _positive_int,
        "padded tokens (longest x count) per batched engine call (default 16384)",
        "N",
    ),
    Option(
        "max_batch_size",
        "--max-batch-size",
        "CLEF_MAX_BATCH_SIZE",
        _positive_int,
        "requests per batched engine call (default 32)",
        "N",
    ),
    Option(
        "max_input_tokens",
        "--max-input-tokens",
        "CLEF_MAX_INPUT_TOKENS",
        _positive_int,
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
        "run each request alone in arrival order: identical requests give identical bytes "
        "(no batching: lower throughput under concurrency)",
        kind="bool",
    ),
    Option(
        "device",
        "--device",
        "CLEF_DEVICE",
        str,
        "torch device, e.g. cpu, cuda, cuda:1 (default: engine's)",
        "DEV",
    ),
    Option(
        "prefill_chunk",
        "--prefill-chunk",
        "CLEF_PREFILL_CHUNK",
        _positive_int,
        "tokens per prefill chunk (default: engine's)",
        "N",
    ),
    Option(
        "max_length",
        "--max-length",
        "CLEF_MAX_LENGTH",
        _positive_int,
        "encoder maximum sequence length (default 16384, as the reference)",
        "N",
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
        "cache_mb",
        "--cache-mb",
        "CLEF_CACHE_MB",
        float,
        "state-cache budget in MiB: repeated states skip their prefill (default: engine's, 10%% of free "
        "memory up to 4 GiB; 0 turns it off)",
        "MB",
    ),
    Option(
        "image_mode",
        "--image-mode",
        "CLEF_IMAGE_MODE",
        str,
        "image preprocessing: native (the reference processor), g256 or g448 (default: native)",
        "MODE",
        choices=("native", "g256", "g448"),
    ),
    Option(
        "image_max_tokens",
        "--image-max-tokens",
        "CLEF_IMAGE_MAX_TOKENS",
        _positive_int,
        "most merged tokens per image in native mode (default: engine's)",
        "N",
    ),
    Option(
        "batch_window_ms",
        "--batch-window-ms",
        "CLEF_BATCH_WINDOW_MS",
        float,
        "how long an idle engine waits for more requests to batch (default 5)",
        "MS",
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
        "log_level",
        "--log-level",
        "CLEF_LOG_LEVEL",
        lambda s: s.strip().lower(),
        "critical, error, warning, info (default) or debug",
        "LEVEL",
    ),
)


def settings_from_namespace(args: argparse.Namespace, environ: Mapping[str, str]) -> ServerSettings:
    """Build settings from parsed CLI flags, falling back to ``CLEF_*`` variables in ``environ``.

    Returns the settings. Raises :class:`SettingsError` naming the flag/variable of any invalid value.
    """
    values: dict[str, Any] = {}
    for option in OPTIONS:
        flag_value = getattr(args, option.field, None)
        if option.kind == "append" and flag_value:
            values[option.field] = tuple(flag_value)
            continue
        if flag_value is not None and option.kind != "append":
            values[option.field] = flag_value
            continue
        raw = environ.get(option.env)
        if raw is None:
            continue
        try:
            if option.kind == "append":
                values[option.field] = _api_keys(raw)
            else:
                value = option.parse(raw)
                if option.choices is not None and value not in option.choices:
                    raise ValueError(f"must be one of {', '.join(option.choices)}")
                values[option.field] = value
        except ValueError as exc:
            raise SettingsError(f"{option.env}={raw!r} (for {option.flag}): {exc}") from None
    if "model" not in values:
        raise SettingsError("--model is required (or set CLEF_MODEL): 'tiny', a directory or a repo id")
    return ServerSettings(**values)
