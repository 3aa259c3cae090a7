"""The backbone features of tuning rows, computed once and kept on disk.

The backbone is frozen, so what the head reads of a row (its final-norm hidden rows, its options' lexical
rows and its `HeadLayout`) is a function of the model's weights, how they compute (dtype, weight mode,
device type) and the row's input: a row's key is the sha256 of exactly those (`model_fingerprint` +
`row_key`). Each row is one safetensors file named by its key (``<cache>/<k[:2]>/<key>.safetensors``: no
pickle), written to a temporary name and renamed once complete, so an interrupted feature pass leaves only
whole files and the next run computes the rest. A file whose metadata does not match the row it is read for
(another format, a damaged file) is treated as missing and recomputed.

Hidden rows are stored in bf16 when that is lossless (a bf16-compute backbone produces bf16 rows:
`Clef.hidden_rows` widens them to fp32 only at the API boundary), else in fp32: half the disk for bf16
models, the same numbers either way.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import save_file
from torch import Tensor

from clef_runtime.engine.executor import head_inputs
from clef_runtime.engine.preparer import PreparedRequest
from clef_runtime.model.head import HeadLayout
from clef_runtime.release import HEAD_WEIGHTS_FILE
from clef_runtime.tuning.rows import TuneRow

__all__ = [
    "FEATURE_FORMAT",
    "FILE_MODE",
    "FeatureStats",
    "FeatureStore",
    "RowFeatures",
    "compute_features",
    "model_fingerprint",
    "row_key",
]

#: The mode of every file `clef tune` writes (features, head, report), whatever the umask or the way the
#: temporary file was made: a server running as another user must read them.
FILE_MODE = 0o644
#: Bump when what a feature file holds or how its key is made changes: old files then simply miss.
FEATURE_FORMAT = 1


@dataclass(frozen=True)
class RowFeatures:
    """What the head reads of one row: ``hidden`` [T, hidden] (bf16 or fp32 as stored), ``lexical``
    [O, hidden] fp32 and the ``layout``."""

    hidden: Tensor
    lexical: Tensor
    layout: HeadLayout


@dataclass(frozen=True)
class FeatureStats:
    """How a feature pass went: distinct rows ``computed`` by the backbone now and found ``cached``."""

    computed: int
    cached: int


def model_fingerprint(clef: Any) -> dict[str, Any]:
    """What the backbone's rows of a given input depend on, as a JSON-able object: the model's name and
    revision, the size and modification time of each weight file of its directory (not the head's: the
    rows do not depend on it), and how it computes (dtype, weight mode, int8 layers, device type)."""
    path = Path(clef.resolved.path)
    files = sorted(
        (item.name, item.stat().st_size, item.stat().st_mtime_ns)
        for item in path.glob("*.safetensors")
        if item.name != HEAD_WEIGHTS_FILE
    )
    return {
        "format": FEATURE_FORMAT,
        "model": clef.resolved.name,
        "revision": clef.resolved.revision,
        "path": str(path.resolve()),
        "files": [list(entry) for entry in files],
        "dtype": clef.card.compute_dtype,
        "weights": clef.card.weight_mode,
        # The selection matters only where layers are quantised (the label reads "int8 layers 12-31, ...").
        "int8_layers": clef.options.int8_layers if clef.options.weights in ("int8", "fp8") else None,
        "device": torch.device(clef.card.device).type,
    }


def row_key(fingerprint: dict[str, Any], prepared: PreparedRequest) -> str:
    """The hex sha256 naming one row's features: the model fingerprint, the row's input ids and the digests
    of its images (in block order)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(fingerprint, sort_keys=True).encode("utf-8"))
    ids = prepared.record.input_ids
    digest.update(len(ids).to_bytes(8, "little"))
    digest.update(b"".join(int(i).to_bytes(4, "little") for i in ids))
    for image in prepared.images:
        digest.update(b"image")
        digest.update(image.digest)
    return digest.hexdigest()


def _layout_json(layout: HeadLayout) -> str:
    return json.dumps(
        {
            "type_ids": [int(t) for t in layout.type_ids],
            "question_spans": [list(span) for span in layout.question_spans],
            "option_spans": [[list(span) for span in spans] for spans in layout.option_spans],
        },
        separators=(",", ":"),
    )


def _layout_from_json(text: str) -> HeadLayout:
    data = json.loads(text)
    return HeadLayout(
        type_ids=[int(t) for t in data["type_ids"]],
        question_spans=[(int(a), int(b)) for a, b in data["question_spans"]],
        option_spans=[[(int(a), int(b)) for a, b in spans] for spans in data["option_spans"]],
    )


def _storage(hidden: Tensor) -> Tensor:
    """``hidden`` in bf16 when that loses nothing, else fp32 (contiguous, CPU)."""
    hidden = hidden.detach().to(device="cpu", dtype=torch.float32).contiguous()
    narrow = hidden.to(torch.bfloat16)
    return narrow if torch.equal(narrow.to(torch.float32), hidden) else hidden


def _laid_out_as(stored: HeadLayout, layout: HeadLayout | None) -> bool:
    """Whether features stored for ``stored`` serve a row laid out as ``layout`` (None: any layout)."""
    return layout is None or _layout_json(stored) == _layout_json(layout)


class FeatureStore:
    """Feature files under one directory (created on the first write)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        """Where the features of ``key`` live."""
        return self.directory / key[:2] / f"{key}.safetensors"

    def _stored_layout(self, key: str, reader: Any) -> HeadLayout | None:
        meta = reader.metadata() or {}
        if meta.get("format") != str(FEATURE_FORMAT) or meta.get("key") != key:
            return None
        return _layout_from_json(meta["layout"])

    def read(self, key: str, layout: HeadLayout | None = None) -> RowFeatures | None:
        """The features of ``key``, or None when there is no usable file: missing, unreadable, of another
        format, or (given ``layout``) made for a row laid out differently."""
        opened = self._open(key, tensors=True)
        if opened is None:
            return None
        stored, tensors = opened
        if tensors is None or not _laid_out_as(stored, layout):
            return None
        hidden, lexical = tensors
        if hidden.dim() != 2 or tuple(lexical.shape) != (stored.num_options, hidden.shape[1]):
            return None
        return RowFeatures(hidden=hidden, lexical=lexical.to(torch.float32), layout=stored)

    def has(self, key: str, layout: HeadLayout | None = None) -> bool:
        """Whether there is a file for ``key`` of this format (and, given ``layout``, made for a row laid
        out so), from its metadata alone; `read` still checks the tensors."""
        opened = self._open(key, tensors=False)
        return opened is not None and _laid_out_as(opened[0], layout)

    def _open(self, key: str, *, tensors: bool) -> tuple[HeadLayout, tuple[Tensor, Tensor] | None] | None:
        """The layout stored in ``key``'s file and, with ``tensors``, its ``hidden`` and ``lexical`` tensors
        (else None: the metadata alone is read); None when there is no file of this format for ``key`` or
        it cannot be read."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            with safetensors.safe_open(str(path), framework="pt", device="cpu") as reader:
                stored = self._stored_layout(key, reader)
                if stored is None:
                    return None
                if not tensors:
                    return stored, None
                return stored, (reader.get_tensor("hidden"), reader.get_tensor("lexical"))
        except (OSError, KeyError, ValueError, safetensors.SafetensorError):
            return None

    def write(self, key: str, features: RowFeatures) -> Path:
        """Writes the features of ``key`` atomically (temporary file, then rename). Raises OSError."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(
                {
                    "hidden": _storage(features.hidden),
                    "lexical": features.lexical.detach().to("cpu", torch.float32).contiguous(),
                },
                str(staged),
                metadata={"format": str(FEATURE_FORMAT), "key": key, "layout": _layout_json(features.layout)},
            )
            staged.chmod(FILE_MODE)
            staged.replace(path)
        finally:
            staged.unlink(missing_ok=True)
        return path


def compute_features(
    clef: Any,
    rows: Sequence[TuneRow],
    prepared_by_key: dict[str, PreparedRequest],
    store: FeatureStore,
    *,
    batch_size: int,
    progress: Callable[[int], Any] | None = None,
) -> FeatureStats:
    """Makes sure every row's features are in ``store``: the rows without a usable file go through the
    backbone (`Clef.hidden_rows`), ``batch_size`` rows per call, and each batch is written as soon as it is
    computed, so an interruption loses at most one batch. ``progress`` is told how many rows each step
    settled. Raises OSError when a file cannot be written, and what `Clef.hidden_rows` raises."""
    missing: list[str] = []
    seen: set[str] = set()
    layouts = {row.key: row.layout for row in rows}
    for row in rows:
        if row.key in seen:
            continue
        seen.add(row.key)
        if not store.has(row.key, row.layout):
            missing.append(row.key)
    if progress is not None and len(seen) > len(missing):
        progress(len(seen) - len(missing))
    for start in range(0, len(missing), batch_size):
        keys = missing[start : start + batch_size]
        prepared = [prepared_by_key[key] for key in keys]
        hiddens = clef.hidden_rows(prepared)
        for key, item, hidden in zip(keys, prepared, hiddens, strict=True):
            layout, lexical = head_inputs(item.record, clef.lexical)
            if _layout_json(layout) != _layout_json(layouts[key]):  # the same encoder made both
                raise ValueError(f"features {key}: the engine's layout differs from the row's")
            store.write(key, RowFeatures(hidden=hidden, lexical=lexical, layout=layout))
        if progress is not None:
            progress(len(keys))
    return FeatureStats(computed=len(missing), cached=len(seen) - len(missing))
