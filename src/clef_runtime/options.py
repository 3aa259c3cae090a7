"""Options: every setting defined once, in a table that generates its CLI flag and its ``CLEF_*`` variable.

Two groups share the machinery:

- :data:`ENGINE_OPTIONS` -> :class:`EngineOptions`, the options of the engine itself (device, weights,
  prefill chunk, lengths, state cache, images, confidence, calibration). ``Clef.load(model, options)``
  takes the object (or the same names as keyword arguments); ``clef decide``, ``serve``, ``bench`` and
  ``eval`` all get their flags from this one table, and ``clef encode`` the encoding subset.
- the server's own options (``clef_runtime.server.settings``), which add HTTP, batching and logging.

A flag beats its variable, the variable beats the default. This module imports nothing heavy (no torch),
so ``clef --help`` and ``clef encode`` stay fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "BF16_COMPUTE_WEIGHT_MODES",
    "COMPUTE_DTYPES",
    "DEFAULT_MAX_LENGTH",
    "ENCODE_OPTION_FIELDS",
    "ENGINE_OPTIONS",
    "EXPLAIN_METHODS",
    "FP32_COMPUTE_WEIGHT_MODES",
    "HEAD_NAME",
    "MODEL_OPTION",
    "EngineOptions",
    "HeadSpec",
    "Option",
    "OptionsError",
    "add_option_arguments",
    "option_table_markdown",
    "parse_bool",
    "parse_head_specs",
    "parse_size",
    "read_option_values",
]

MiB = 1024 * 1024

#: The reference encoder's ``max_length`` (tokens per row).
DEFAULT_MAX_LENGTH = 16384

#: Most merged tokens per image in ``native`` mode (the hosted service's cap).
DEFAULT_IMAGE_MAX_TOKENS = 1024

WEIGHT_MODES = ("auto", "fp32", "bf16-storage", "int8", "fp8")
COMPUTE_DTYPES = ("auto", "fp32", "bf16")
#: The weight modes that are storage under fp32 compute (not with --dtype bf16; under auto they mean fp32).
FP32_COMPUTE_WEIGHT_MODES = ("fp32", "bf16-storage", "int8")
#: The weight modes that compute in bf16 (not with --dtype fp32; under auto they mean bf16): fp8's products
#: come out in bf16 (`clef_runtime.model.fp8`).
BF16_COMPUTE_WEIGHT_MODES = ("fp8",)
IMAGE_MODES = ("native", "g256", "g448")
CONFIDENCE_MODES = ("seed", "typesafe", "workers-ai")
#: How ``x_explain`` weighs the state (`clef_runtime.model.attribution`); the first is the default, chosen
#: by the faithfulness measurements of docs/explain.md.
EXPLAIN_METHODS = ("integrated_gradients", "gradient_x_input", "attention")


class OptionsError(ValueError):
    """An option has an invalid value; the message names the flag (and its variable when it came from it)."""


# ---------------------------------------------------------------------------------------------- parsers


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


def parse_int(text: str) -> int:
    """An integer (surrounding spaces allowed). Raises ``ValueError``."""
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"not an integer: {text!r} (e.g. 8)") from None


def parse_float(text: str) -> float:
    """A finite float. Raises ``ValueError``."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError(f"not a number: {text!r} (e.g. 2.5)") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type``: its ValueError becomes the usage error's own text. Without it,
    argparse replaces the message with ``invalid <function name> value``, naming our parser, not what the
    flag expects."""

    def parse_argument(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_argument


def parse_lower(text: str) -> str:
    """The text stripped and lower-cased (for choices)."""
    return text.strip().lower()


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


def add_option_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, options: Iterable[Option]
) -> None:
    """Add one flag per option to ``parser``. Every flag defaults to None so that :func:`read_option_values`
    can fall back to the variable, then to the default; ``--help`` names the variable."""
    for option in options:
        help_text = f"{option.help} [env {option.env}]".replace("%", "%%")
        if option.kind == "bool":
            parser.add_argument(
                option.flag,
                dest=option.field,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif option.kind == "append":
            parser.add_argument(
                option.flag,
                dest=option.field,
                action="append",
                default=None,
                metavar=option.metavar,
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=option.field,
                type=_argument_type(option.parse),
                default=None,
                metavar=option.metavar,
                choices=option.choices,
                help=help_text,
            )


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def read_option_values(
    args: argparse.Namespace | None, environ: Mapping[str, str], options: Iterable[Option]
) -> dict[str, Any]:
    """The values given for ``options``: from the parsed flags in ``args`` first, else from ``environ``.

    Options given neither way are left out (so the dataclass default applies). Raises :class:`OptionsError`
    naming the variable of an invalid value (argparse already refused invalid flags).
    """
    values: dict[str, Any] = {}
    for option in options:
        flag_value = getattr(args, option.field, None) if args is not None else None
        if flag_value is not None:
            values[option.field] = tuple(flag_value) if option.kind == "append" else flag_value
            continue
        raw = environ.get(option.env)
        if raw is None:
            continue
        try:
            if option.kind == "append":
                values[option.field] = _comma_list(raw)
            else:
                value = option.parse(raw)
                if option.choices is not None and value not in option.choices:
                    raise ValueError(f"must be one of {', '.join(option.choices)}")
                values[option.field] = value
        except ValueError as exc:
            raise OptionsError(f"{option.env}={raw!r} (for {option.flag}): {exc}") from None
    return values


def option_table_markdown(options: Iterable[Option]) -> str:
    """A markdown table of flags, variables and help texts (README.md's options table is this output)."""
    lines = ["| flag | variable | meaning |", "|---|---|---|"]
    for option in options:
        flag = option.flag + (f" {option.metavar}" if option.metavar else "")
        lines.append(f"| `{flag}` | `{option.env}` | {option.help} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- heads

#: A head's name: what a request's ``model`` says to pick it.
HEAD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


@dataclass(frozen=True)
class HeadSpec:
    """One ``--head`` value: ``name`` None for a bare ``DIR`` (it replaces the default head)."""

    name: str | None
    path: Path

    @classmethod
    def parse(cls, text: str) -> HeadSpec:
        """``NAME=DIR`` or ``DIR``. Raises `OptionsError` naming ``--head`` for a bad name or an empty path
        (the directory itself is checked when the head loads)."""
        name, sep, path = text.partition("=")
        if not sep or "/" in name or "\\" in name:
            # No "=", or a path that itself contains "=" after a separator: a bare directory.
            name, path = "", text
        name, path = name.strip(), path.strip()
        if sep and not name and path and text.lstrip().startswith("="):
            raise OptionsError(
                f"--head {text!r}: the name before '=' is empty; give NAME=DIR, or DIR alone to replace the "
                "release head"
            )
        if sep and name and not HEAD_NAME.fullmatch(name):
            raise OptionsError(
                f"--head {text!r}: the name must be 1-64 letters, digits, '.', '_', ':' or '-', starting "
                "with a letter or digit"
            )
        if not path:
            raise OptionsError(f"--head {text!r}: no directory")
        return cls(name or None, Path(path).expanduser())


def parse_head_specs(values: Iterable[str]) -> list[HeadSpec]:
    """Every ``--head`` value parsed; raises `OptionsError` for a bad one, a repeated name or more than one
    bare directory."""
    specs = [HeadSpec.parse(value) for value in values]
    names = [spec.name for spec in specs if spec.name is not None]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise OptionsError(f"--head: the name(s) {', '.join(repeated)} are given more than once")
    if sum(spec.name is None for spec in specs) > 1:
        raise OptionsError("--head: at most one head without a name (it replaces the release's head)")
    return specs


# ------------------------------------------------------------------------------------------- the model

MODEL_OPTION = Option(
    "model",
    "--model",
    "CLEF_MODEL",
    str,
    "'tiny' (built-in untrained test model), a local release directory, or a Hugging Face repo id with an "
    "optional @revision (Cloudflare/clef-flash and Cloudflare/clef default to their pinned revisions)",
    "M",
)


# ------------------------------------------------------------------------------------------ the engine


@dataclass(frozen=True)
class EngineOptions:
    """Every option of the engine, validated. Immutable: use :meth:`replace` to change one.

    The same fields are the keyword arguments of ``Clef.load`` and, through :data:`ENGINE_OPTIONS`, the
    flags and ``CLEF_*`` variables of ``clef decide / serve / bench / eval``.
    """

    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "auto"
    """The backbone's compute dtype: ``auto`` (bf16 on CUDA and on CPUs with native bf16 where it measures
    faster, else fp32), ``fp32`` (the reference's numbers) or ``bf16``. The head always computes in fp32."""
    weights: str = "auto"
    """CPU weight storage: ``auto``, ``fp32``, ``bf16-storage`` or ``int8`` (see ``--int8-layers``); on a CUDA
    GPU of compute capability 8.9 or newer also ``fp8`` (bf16 compute)."""
    int8_layers: str = "late"
    """With ``weights=int8`` or ``fp8``: ``late`` (from 3/8 of the depth on), ``all``, or comma-separated
    indices."""
    prefill_chunk: int | None = None
    """Run the backbone in calls of at most this many tokens (None: whole rows)."""
    max_step_tokens: int | None = None
    """Padded tokens one engine step computes (None: the device's default, small on CPU, large on CUDA)."""
    pad_last_chunk: bool = False
    """The seed's readout: one row at a time in ``prefill_chunk`` calls, the last padded (no state cache)."""
    max_length: int = DEFAULT_MAX_LENGTH
    """The encoder's maximum sequence length (the reference's ``max_length``)."""
    cache_mb: float | None = None
    """State-cache budget in MiB; None: 10% of the available memory, at most 4 GiB; 0: off."""
    snapshot_interval: int = 512
    """Inside long states, a state-cache snapshot every this many tokens (0: none)."""
    image_mode: str = "native"
    """``native`` (the reference processor), ``g256`` or ``g448`` (fixed square tiles)."""
    image_max_tokens: int | None = DEFAULT_IMAGE_MAX_TOKENS
    """Most merged tokens per image in native mode (None: uncapped)."""
    check_memory: bool = True
    """Estimate the memory need from the safetensors headers first and refuse cleanly when it cannot fit."""
    fused_kernels: bool = True
    """On CUDA, use the fused Gated DeltaNet kernels of the ``cuda`` extra where installed (False:
    transformers' reference PyTorch functions, for comparison; process-wide)."""
    confidence: str = "seed"
    """Confidence of choice and score answers: ``seed`` (top probability), ``typesafe``, ``workers-ai``."""
    explain_method: str = EXPLAIN_METHODS[0]
    """How ``x_explain`` weighs the state: ``integrated_gradients`` (the default, the most faithful measured),
    ``gradient_x_input`` or ``attention`` (docs/explain.md)."""
    calibration: str | None = None
    """A calibration.json (from ``clef calibrate``) applied to every answer's probabilities."""
    head: tuple[str, ...] = ()
    """Tuned heads served on the same backbone, ``NAME=DIR`` (a request's ``model`` = NAME picks it) or one
    bare ``DIR`` (replaces the release's head); see `clef_runtime.engine.heads`."""

    def __post_init__(self) -> None:
        problems = []
        if not _valid_device(self.device):
            problems.append(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in COMPUTE_DTYPES:
            problems.append(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.dtype!r}")
        elif self.dtype == "bf16" and self.weights in FP32_COMPUTE_WEIGHT_MODES:
            problems.append(
                f"--weights {self.weights} is a storage mode for fp32 compute: not with --dtype bf16"
            )
        if self.weights not in WEIGHT_MODES:
            problems.append(f"--weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        problems += _bf16_weight_mode_problems(self.weights, self.dtype, self.device)
        if not _valid_int8_layers(self.int8_layers):
            problems.append(
                f"--int8-layers must be late, all or comma-separated layer indices, got {self.int8_layers!r}"
            )
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            problems.append(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            problems.append(f"--max-step-tokens must be at least 1, got {self.max_step_tokens}")
        if self.pad_last_chunk and self.prefill_chunk is None:
            problems.append("pad_last_chunk needs a prefill_chunk")
        if self.max_length < 1:
            problems.append(f"--max-length must be at least 1, got {self.max_length}")
        if self.cache_mb is not None and not self.cache_mb >= 0:
            problems.append(f"--cache-mb must be >= 0, got {self.cache_mb}")
        if self.snapshot_interval < 0:
            problems.append(f"--snapshot-interval must be >= 0, got {self.snapshot_interval}")
        if self.image_mode not in IMAGE_MODES:
            problems.append(f"--image-mode must be one of {', '.join(IMAGE_MODES)}, got {self.image_mode!r}")
        if self.image_max_tokens is not None and self.image_max_tokens < 1:
            problems.append(f"--image-max-tokens must be at least 1, got {self.image_max_tokens}")
        if self.explain_method not in EXPLAIN_METHODS:
            problems.append(
                f"--explain-method must be one of {', '.join(EXPLAIN_METHODS)}, got {self.explain_method!r}"
            )
        if self.confidence not in CONFIDENCE_MODES:
            problems.append(
                f"--confidence must be one of {', '.join(CONFIDENCE_MODES)}, got {self.confidence!r}"
            )
        if isinstance(self.head, str):
            object.__setattr__(self, "head", (self.head,))
        try:
            parse_head_specs(self.head)
        except OptionsError as exc:
            problems.append(str(exc))
        if problems:
            raise OptionsError("; ".join(problems))

    def replace(self, **changes: Any) -> EngineOptions:
        """A copy with ``changes`` applied (validated). Raises :class:`OptionsError` (or TypeError for an
        unknown name)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The options as a plain dict (for logs, /v1/models and benchmark records)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_sources(
        cls,
        args: argparse.Namespace | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        fields: Sequence[str] | None = None,
    ) -> EngineOptions:
        """Options from parsed flags, else ``CLEF_*`` variables, else the defaults. ``fields`` restricts
        the options read (``clef encode`` reads only the encoding ones). Raises :class:`OptionsError`."""
        table = ENGINE_OPTIONS if fields is None else [o for o in ENGINE_OPTIONS if o.field in fields]
        return cls(**read_option_values(args, environ or {}, table))


def _valid_device(device: str) -> bool:
    return bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", device))


def _bf16_weight_mode_problems(weights: str, dtype: str, device: str) -> list[str]:
    """What rules out a bf16-compute weight mode (fp8) before anything loads: fp32 compute or the CPU (whether
    a CUDA device can run it is asked of the device at load: `clef_runtime.model.fp8.check_fp8_device`)."""
    if weights not in BF16_COMPUTE_WEIGHT_MODES:
        return []
    problems = []
    if dtype == "fp32":
        problems.append(f"--weights {weights} computes in bf16 (fp8 products, bf16 output): not --dtype fp32")
    if device == "cpu":
        problems.append(
            f"--weights {weights} needs a CUDA GPU of compute capability 8.9 or newer: not with --device cpu"
        )
    return problems


def _valid_int8_layers(text: str) -> bool:
    return text in ("late", "all") or bool(re.fullmatch(r"\d+(\s*,\s*\d+)*", text.strip()))


ENGINE_OPTIONS: tuple[Option, ...] = (
    Option(
        "device",
        "--device",
        "CLEF_DEVICE",
        parse_lower,
        "torch device: auto (CUDA when available, else CPU), cpu, cuda, cuda:N (default auto)",
        "DEV",
    ),
    Option(
        "dtype",
        "--dtype",
        "CLEF_DTYPE",
        parse_lower,
        "backbone compute dtype: auto (bf16 on CUDA, and on CPUs with AVX512_BF16 or AMX where a GEMM "
        "measured at load is faster; else fp32), fp32 (the reference's numbers) or bf16; the head always "
        "computes in fp32 (default auto)",
        "DTYPE",
        choices=COMPUTE_DTYPES,
    ),
    Option(
        "weights",
        "--weights",
        "CLEF_WEIGHTS",
        parse_lower,
        "CPU weight storage under fp32 compute: auto (fp32 when it fits, else bf16 storage with fp32 "
        "compute, int8 only when neither fits, saying so in the log), fp32, bf16-storage, or int8 (opt-in: "
        "changes numbers, see --int8-layers); a mode other than auto means fp32 compute under --dtype auto; "
        "with bf16 compute auto holds the weights in bf16; on a CUDA GPU of compute capability 8.9+ (Ada, "
        "Hopper) also fp8 (opt-in: e4m3 decoder Linears of the --int8-layers selection, bf16 compute; "
        "changes numbers) (default auto)",
        "MODE",
        choices=WEIGHT_MODES,
    ),
    Option(
        "int8_layers",
        "--int8-layers",
        "CLEF_INT8_LAYERS",
        str.strip,
        "with --weights int8 or fp8: late (layers from 3/8 of the depth on, default), all, or "
        "comma-separated layer indices",
        "LAYERS",
    ),
    Option(
        "prefill_chunk",
        "--prefill-chunk",
        "CLEF_PREFILL_CHUNK",
        parse_int,
        "run the backbone in calls of N tokens over the hybrid cache (default: one pass)",
        "N",
    ),
    Option(
        "max_step_tokens",
        "--max-step-tokens",
        "CLEF_MAX_STEP_TOKENS",
        parse_int,
        "padded tokens one engine step computes: long requests run in chunks across steps, short ones "
        "overtake between chunks (default: 1024 on CPU, 16384 on CUDA)",
        "N",
    ),
    Option(
        "max_length",
        "--max-length",
        "CLEF_MAX_LENGTH",
        parse_int,
        "maximum tokens per request; longer states lose their tail (default 16384, as the reference)",
        "N",
    ),
    Option(
        "cache_mb",
        "--cache-mb",
        "CLEF_CACHE_MB",
        parse_float,
        "state-cache budget in MiB: repeated and growing states skip their prefill (default 10% of free "
        "memory up to 4 GiB; 0 turns it off)",
        "MB",
    ),
    Option(
        "snapshot_interval",
        "--snapshot-interval",
        "CLEF_SNAPSHOT_INTERVAL",
        parse_int,
        "inside long states, keep a state-cache snapshot every N tokens so extended states resume near "
        "their end (default 512; 0: only at state ends)",
        "N",
    ),
    Option(
        "image_mode",
        "--image-mode",
        "CLEF_IMAGE_MODE",
        parse_lower,
        "image preprocessing: native (the reference processor), g256 or g448 (default native)",
        "MODE",
        choices=IMAGE_MODES,
    ),
    Option(
        "image_max_tokens",
        "--image-max-tokens",
        "CLEF_IMAGE_MAX_TOKENS",
        parse_int,
        "most merged tokens per image in native mode (default 1024)",
        "N",
    ),
    Option(
        "confidence",
        "--confidence",
        "CLEF_CONFIDENCE",
        parse_lower,
        "confidence of choice/score answers: seed (top probability, default), typesafe "
        "(chance-corrected) or workers-ai ((n*sum p^2 - 1)/(n - 1))",
        "MODE",
        choices=CONFIDENCE_MODES,
    ),
    Option(
        "explain_method",
        "--explain-method",
        "CLEF_EXPLAIN_METHOD",
        parse_lower,
        "how x_explain weighs the state: integrated_gradients (default; the most faithful measured), "
        "gradient_x_input or attention (docs/explain.md)",
        "METHOD",
        choices=EXPLAIN_METHODS,
    ),
    Option(
        "fused_kernels",
        "--fused-kernels",
        "CLEF_FUSED_KERNELS",
        parse_bool,
        "on CUDA, use the fused Gated DeltaNet kernels (flash-linear-attention, causal-conv1d: the 'cuda' "
        "extra) where installed; --no-fused-kernels for the reference PyTorch path (default on)",
        kind="bool",
    ),
    Option(
        "calibration",
        "--calibration",
        "CLEF_CALIBRATION",
        str,
        "a calibration.json from 'clef calibrate': temperatures applied to every answer (default none)",
        "FILE",
    ),
    Option(
        "head",
        "--head",
        "CLEF_HEAD",
        str,
        "another head on the same backbone (a directory in the release's head layout): NAME=DIR answers "
        "requests whose model is NAME, a bare DIR replaces the release's head; repeatable (variable: "
        "comma-separated)",
        "[NAME=]DIR",
        kind="append",
    ),
)

#: The engine options that change how a request is encoded (``clef encode`` takes only these).
ENCODE_OPTION_FIELDS = ("max_length", "image_mode", "image_max_tokens")
