"""The Clef release layout, the known releases and their pinned revisions, and the layout's verification.

A release directory (Cloudflare/clef-flash, Cloudflare/clef, or the built-in tiny checkpoint, which has the
same layout) has:

- ``config.json``: a ``Qwen3_5ForConditionalGeneration`` config (``model_type`` ``qwen3_5``);
- ``model-0000N-of-0000M.safetensors`` shards and ``model.safetensors.index.json`` (backbone, vision tower and
  ``lm_head.weight``);
- ``joint_head.safetensors`` and ``joint_head_config.json`` (the JointSchemaHead);
- ``tokenizer.json``, ``tokenizer_config.json`` and ``processor_config.json``.

``generation_config.json``, ``chat_template.jinja`` and ``joint_schema_model.py`` may be present and are
ignored: the runtime never imports or executes code that ships with a checkpoint.

`verify_checkpoint` checks all of this from the file system and the safetensors headers only (it never reads
tensor data), so it is cheap even for the 18.8 GB Clef-flash release (or the 27B Clef), and it runs before
anything is loaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_runtime.model.load_errors import ModelLoadError
from clef_runtime.release import (
    CONFIG_FILE,
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    INDEX_FILE,
    LM_HEAD_TENSOR,
    PROCESSOR_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)

__all__ = [
    "CLEF_27B",
    "CLEF_FLASH",
    "KNOWN_RELEASES",
    "PINNED_FILE_SIZES",
    "PINNED_REPO_ID",
    "PINNED_REVISION",
    "RELEASE_ARCHITECTURE",
    "RELEASE_FILE_PATTERNS",
    "RELEASE_MODEL_TYPE",
    "REQUIRED_FILES",
    "SAFETENSORS_DTYPE_SIZES",
    "TINY_DESCRIPTION",
    "TINY_RELEASE_DATE",
    "CheckpointError",
    "CheckpointInfo",
    "KnownRelease",
    "ModelCard",
    "TensorInfo",
    "known_release",
    "model_card",
    "read_safetensors_header",
    "verify_checkpoint",
]

REQUIRED_FILES: tuple[str, ...] = (
    CONFIG_FILE,
    INDEX_FILE,
    HEAD_WEIGHTS_FILE,
    HEAD_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    PROCESSOR_CONFIG_FILE,
)

# Glob patterns of the files the runtime uses: what a download fetches (never *.py).
RELEASE_FILE_PATTERNS: tuple[str, ...] = (
    CONFIG_FILE,
    INDEX_FILE,
    "model-*-of-*.safetensors",
    HEAD_WEIGHTS_FILE,
    HEAD_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    PROCESSOR_CONFIG_FILE,
)

RELEASE_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
RELEASE_MODEL_TYPE = "qwen3_5"


@dataclass(frozen=True)
class KnownRelease:
    """A published Clef release: its Hugging Face repo id (as Cloudflare spells it), the revision
    ``--model <repo_id>`` loads when no ``@revision`` is given, and, where they are published, the byte
    sizes of that revision's files (checked by `verify_checkpoint` before anything is parsed; None where
    they are not known, and then nothing is checked against them) and its release date (``/v1/models``;
    None where it is not published)."""

    repo_id: str
    revision: str
    title: str
    file_sizes: Mapping[str, int] | None = field(default=None, repr=False)
    release_date: str | None = None


# Published byte sizes of the pinned Clef-flash revision's files (docs/model.md section 2). Checked before any
# file is parsed when the caller asks for the pinned revision: a partial download or another revision shows.
PINNED_FILE_SIZES: Mapping[str, int] = {
    CONFIG_FILE: 2_832,
    HEAD_CONFIG_FILE: 119,
    HEAD_WEIGHTS_FILE: 243_538_016,
    "model-00001-of-00004.safetensors": 4_942_706_120,
    "model-00002-of-00004.safetensors": 4_987_757_928,
    "model-00003-of-00004.safetensors": 4_954_810_240,
    "model-00004-of-00004.safetensors": 3_934_446_832,
    INDEX_FILE: 69_253,
    PROCESSOR_CONFIG_FILE: 1_191,
    TOKENIZER_FILE: 19_989_325,
    TOKENIZER_CONFIG_FILE: 1_075,
}

#: Clef-flash: the Qwen3.5-9B backbone (docs/model.md).
CLEF_FLASH = KnownRelease(
    repo_id="Cloudflare/clef-flash",
    revision="17f0b0ad64efb65d273590632833508766b2aae6",
    title="Clef-flash (9B)",
    file_sizes=PINNED_FILE_SIZES,
    release_date="2026-10-01",
)
#: Clef: the Qwen3.5-27B backbone (docs/clef-27b.md). Its file sizes and release date are not published: no
#: size is checked, and ``/v1/models`` says the date is unknown.
CLEF_27B = KnownRelease(
    repo_id="Cloudflare/clef",
    revision="2f3de3dd85f379784083b0814d997ab627200f0c",
    title="Clef (27B)",
)

#: The known releases by lower-cased repo id (the Hub matches repo ids case-insensitively).
KNOWN_RELEASES: Mapping[str, KnownRelease] = {
    release.repo_id.lower(): release for release in (CLEF_FLASH, CLEF_27B)
}

# The names from when Clef-flash was the only known release; they still mean Clef-flash.
PINNED_REPO_ID = CLEF_FLASH.repo_id
PINNED_REVISION = CLEF_FLASH.revision


def known_release(repo_id: str) -> KnownRelease | None:
    """The known release ``repo_id`` names (any letter case, no ``@revision``), or None."""
    return KNOWN_RELEASES.get(repo_id.strip().lower())


#: The tiny checkpoint's card: random weights in the release layout (`clef_runtime.model.tiny`).
TINY_DESCRIPTION = (
    "tiny: an UNTRAINED Clef checkpoint with random weights in the release layout, for tests and demos; "
    "its answers are meaningless"
)
TINY_RELEASE_DATE = "2026-11-29"


@dataclass(frozen=True)
class ModelCard:
    """How ``/v1/models`` presents a model: its name, a one-line description, its release date (None: not
    published) and whether its weights are random (the tiny checkpoint: the server says so)."""

    name: str
    description: str
    release_date: str | None
    untrained: bool = False


def model_card(name: str, *, untrained: bool) -> ModelCard:
    """The card of the model loaded as ``name`` (``ResolvedModel.name``). A known release's repo id gets its
    release date; a release under another name (a local directory, a mirror) is taken for Clef-flash, the
    release the runtime was built for."""
    if untrained:
        return ModelCard(name, TINY_DESCRIPTION, TINY_RELEASE_DATE, untrained=True)
    release = known_release(name) or CLEF_FLASH
    return ModelCard(name, f"{name}: Cloudflare's Clef decision model", release.release_date)


# Bytes per element of every dtype the safetensors format defines.
SAFETENSORS_DTYPE_SIZES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# safetensors itself refuses headers above 100 MB; a larger length prefix means a corrupt or foreign file.
_MAX_HEADER_BYTES = 100_000_000
# Shard names come from a JSON file: only plain file names, so an index can never point outside the directory.
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")
_HEAD_CONFIG_KEYS = ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")


class CheckpointError(ModelLoadError, ValueError):
    """A checkpoint directory is missing a file or holds a file that is malformed.

    ``file`` is the offending path (or None when the problem is not tied to one file); the message names it.
    """

    def __init__(self, message: str, *, file: Path | None = None) -> None:
        super().__init__(message)
        self.file = file


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by a safetensors header (no data read)."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored data."""
        return self.numel * SAFETENSORS_DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class CheckpointInfo:
    """What `verify_checkpoint` learned about a release directory.

    ``shards`` are the shard file names in index order; ``total_weight_bytes`` and ``tensor_count`` cover the
    backbone shards (text, vision and ``lm_head``), not the head; ``tensors`` maps every backbone tensor name
    to its header entry and ``head_tensors`` does the same for ``joint_head.safetensors``.
    """

    path: Path
    config: dict[str, Any]
    head_config: dict[str, Any]
    shards: tuple[str, ...]
    total_weight_bytes: int
    tensor_count: int
    is_tiny: bool
    tensors: Mapping[str, TensorInfo] = field(repr=False)
    head_tensors: Mapping[str, TensorInfo] = field(repr=False)

    @property
    def text_config(self) -> dict[str, Any]:
        """The ``text_config`` section of config.json."""
        return self.config["text_config"]

    @property
    def hidden_size(self) -> int:
        """The backbone's hidden size (4096 for Clef-flash, 5120 for Clef)."""
        return int(self.text_config["hidden_size"])

    def shard_path(self, name: str) -> Path:
        """Absolute path of one shard file."""
        return self.path / name


def _fail(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}", file=path)


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise _fail(path, "required file is missing")
    try:
        with path.open("rb") as handle:
            value = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _fail(path, f"is not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise _fail(path, f"must hold a JSON object, found {type(value).__name__}")
    return value


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors file's header without reading any tensor data.

    Checks the 8-byte length prefix, the JSON header, every entry's dtype/shape/offsets, that the offsets tile
    the data section exactly (as the safetensors library requires) and that the file is exactly as long as the
    header says. Returns the tensors by name. Raises `CheckpointError` naming the file on any problem.
    """
    try:
        file_size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _fail(path, f"truncated safetensors file: {file_size} bytes, no 8-byte header length")
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length > _MAX_HEADER_BYTES or 8 + header_length > file_size:
                raise _fail(
                    path,
                    f"corrupt or truncated safetensors header: declares {header_length} header bytes, "
                    f"file has {file_size} bytes",
                )
            raw_header = handle.read(header_length)
    except FileNotFoundError as error:
        raise _fail(path, "file is missing") from error
    except OSError as error:
        raise _fail(path, f"cannot be read ({error})") from error
    try:
        header = json.loads(raw_header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _fail(path, f"safetensors header is not valid JSON ({error})") from error
    if not isinstance(header, dict):
        raise _fail(path, "safetensors header is not a JSON object")

    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise _fail(path, f"safetensors header entry {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPE_SIZES:
            raise _fail(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise _fail(path, f"tensor {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise _fail(path, f"tensor {name!r} has invalid data_offsets {offsets!r}")
        info = TensorInfo(name=name, file=path.name, dtype=dtype, shape=tuple(shape))
        if offsets[1] - offsets[0] != info.nbytes:
            raise _fail(
                path,
                f"tensor {name!r} {dtype}{list(shape)} needs {info.nbytes} bytes but its data_offsets span "
                f"{offsets[1] - offsets[0]}",
            )
        tensors[name] = info
        spans.append((offsets[0], offsets[1], name))

    spans.sort()
    position = 0
    for start, end, name in spans:
        if start != position:
            raise _fail(path, f"tensor {name!r} data starts at {start}, expected {position} (gap or overlap)")
        position = end
    data_bytes = file_size - 8 - header_length
    if position != data_bytes:
        state = "truncated" if position > data_bytes else "longer than its header describes"
        raise _fail(
            path,
            f"file is {state}: the header describes {position} bytes of tensor data, "
            f"the file holds {data_bytes}",
        )
    return tensors


def _check_sizes(directory: Path, expected_sizes: Mapping[str, int]) -> None:
    problems: list[tuple[Path, str]] = []
    for name, expected in sorted(expected_sizes.items()):
        path = directory / name
        try:
            actual = path.stat().st_size
        except FileNotFoundError:
            problems.append((path, f"{path}: missing (expected {expected:,} bytes)"))
            continue
        if actual != expected:
            problems.append((path, f"{path}: {actual:,} bytes, expected {expected:,}"))
    if problems:
        raise CheckpointError(
            "checkpoint files do not have the published sizes of the pinned revision "
            "(partial download or a different revision?): " + "; ".join(text for _, text in problems),
            file=problems[0][0],
        )


def _check_config(path: Path, config: dict[str, Any]) -> None:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or RELEASE_ARCHITECTURE not in architectures:
        raise _fail(path, f"architectures must include {RELEASE_ARCHITECTURE!r}, found {architectures!r}")
    if config.get("model_type") != RELEASE_MODEL_TYPE:
        raise _fail(path, f"model_type must be {RELEASE_MODEL_TYPE!r}, found {config.get('model_type')!r}")
    text_config = config.get("text_config")
    if not isinstance(text_config, dict):
        raise _fail(path, "text_config is missing or not an object")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
        value = text_config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(path, f"text_config.{key} must be a positive integer, found {value!r}")
    marker = config.get("clef_runtime")
    if marker is not None and not isinstance(marker, dict):
        raise _fail(path, f"clef_runtime marker must be an object, found {marker!r}")


def _check_head_config(path: Path, head_config: dict[str, Any], hidden_size: int) -> None:
    for key in _HEAD_CONFIG_KEYS:
        value = head_config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(path, f"{key} must be a positive integer, found {value!r}")
    if head_config["hidden_size"] != hidden_size:
        raise _fail(
            path,
            f"hidden_size {head_config['hidden_size']} does not match the backbone's "
            f"hidden_size {hidden_size}",
        )
    if head_config["width"] % head_config["heads"]:
        raise _fail(path, f"width {head_config['width']} is not divisible by heads {head_config['heads']}")


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    expected_sizes: Mapping[str, int] | None = None,
    parse_tokenizer: bool = True,
) -> CheckpointInfo:
    """Verify a release directory without loading any weights.

    When ``expected_sizes`` is given (a `KnownRelease`'s ``file_sizes``, e.g. `PINNED_FILE_SIZES` for the
    pinned Clef-flash revision), the listed files' byte sizes are checked first, before any file is parsed.
    Then: every required file exists and each JSON file parses; the index's ``weight_map`` names only shard
    files that exist; every shard's safetensors header parses and its tensors are exactly the ones the index
    assigns to it; ``lm_head.weight`` exists; the head's safetensors header parses and its config matches the
    backbone's hidden size.

    ``parse_tokenizer=False`` checks that ``tokenizer.json`` exists but leaves parsing it to the caller: a
    loader that parses it with ``tokenizers`` next (``Clef.load``) would otherwise parse ~15 MB twice.

    Returns a `CheckpointInfo`. Raises `CheckpointError` (a ValueError) naming the offending file.
    """
    directory = Path(path).expanduser().resolve()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist", file=directory)
    if expected_sizes is not None:
        _check_sizes(directory, expected_sizes)

    for name in REQUIRED_FILES:
        if not (directory / name).is_file():
            raise _fail(directory / name, "required file is missing")

    config = _read_json_object(directory / CONFIG_FILE)
    _check_config(directory / CONFIG_FILE, config)
    hidden_size = int(config["text_config"]["hidden_size"])
    head_config = _read_json_object(directory / HEAD_CONFIG_FILE)
    _check_head_config(directory / HEAD_CONFIG_FILE, head_config, hidden_size)
    index_path = directory / INDEX_FILE
    index = _read_json_object(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise _fail(index_path, "weight_map is missing or empty")
    by_shard: dict[str, set[str]] = {}
    for tensor_name, shard_name in weight_map.items():
        if not isinstance(shard_name, str) or not _SHARD_NAME.match(shard_name):
            raise _fail(
                index_path, f"weight_map entry {tensor_name!r} names an invalid shard file {shard_name!r}"
            )
        by_shard.setdefault(shard_name, set()).add(tensor_name)
    if LM_HEAD_TENSOR not in weight_map:
        raise _fail(index_path, f"weight_map has no {LM_HEAD_TENSOR!r} (the head reads its rows)")
    shards = tuple(by_shard)
    for shard_name in shards:
        if not (directory / shard_name).is_file():
            raise _fail(directory / shard_name, f"shard named by {INDEX_FILE} is missing")

    tensors: dict[str, TensorInfo] = {}
    for shard_name in shards:
        shard_path = directory / shard_name
        header = read_safetensors_header(shard_path)
        expected = by_shard[shard_name]
        if set(header) != expected:
            missing = sorted(expected - set(header))
            extra = sorted(set(header) - expected)
            details = []
            if missing:
                details.append(f"missing tensors the index assigns to it: {missing[:5]}")
            if extra:
                details.append(f"tensors the index does not list for it: {extra[:5]}")
            raise _fail(shard_path, "does not match " + INDEX_FILE + ": " + "; ".join(details))
        tensors.update(header)

    head_path = directory / HEAD_WEIGHTS_FILE
    head_tensors = read_safetensors_header(head_path)
    if not head_tensors:
        raise _fail(head_path, "holds no tensors")

    # tokenizer.json last: at ~20 MB it is the slowest file to parse, and the cheaper checks come first.
    json_files = [TOKENIZER_CONFIG_FILE, PROCESSOR_CONFIG_FILE]
    for name in [*json_files, TOKENIZER_FILE] if parse_tokenizer else json_files:
        _read_json_object(directory / name)

    marker = config.get("clef_runtime") or {}
    return CheckpointInfo(
        path=directory,
        config=config,
        head_config=head_config,
        shards=shards,
        total_weight_bytes=sum(info.nbytes for info in tensors.values()),
        tensor_count=len(tensors),
        is_tiny=marker.get("tiny") is True,
        tensors=tensors,
        head_tensors=head_tensors,
    )
