"""The one safetensors shard reader: every consumer of a checkpoint's weights (the backbone, the vision
tower, the lexical rows of ``lm_head``) finds and opens shards here, so that every one checks paths the same
way: a shard named by the index must be a file inside the checkpoint directory.

Only safetensors are read (never pickle); tensors are yielded one at a time so that a caller that converts
and keeps each holds at most one extra tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clef_runtime.release import INDEX_FILE, SINGLE_WEIGHTS_FILE

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "ShardError",
    "ShardIndex",
    "ShardsNotFoundError",
    "open_index",
    "read_shard",
    "read_tensors",
    "shard_path",
]


class ShardError(ValueError):
    """A shard or shard index that cannot be used; ``file`` is the offending path and the message names it."""

    def __init__(self, message: str, file: Path) -> None:
        super().__init__(message)
        self.file = file


class ShardsNotFoundError(ShardError, FileNotFoundError):
    """The directory has neither a shard index nor a single weights file."""


def shard_path(root: Path, name: str) -> Path:
    """``root / name`` for a shard named by an index. Raises `ShardError` when the name leaves ``root``
    (an absolute path, ``..``). Checked on the name, not on where links point: a Hugging Face snapshot
    directory holds links into the cache's blob store."""
    path = Path(os.path.normpath(root / name))
    if not path.is_relative_to(os.path.normpath(root)):
        raise ShardError(
            f"{root / name}: safetensors shard {name!r} is outside the checkpoint directory", root
        )
    return path


@dataclass(frozen=True)
class ShardIndex:
    """Where each tensor of a checkpoint is: ``source`` (the index file, or the one weights file) and
    ``shards`` (tensor name -> shard file, every one checked by `shard_path`)."""

    source: Path
    shards: Mapping[str, Path]

    def shard_of(self, name: str) -> Path:
        """The shard holding ``name``. Raises `ShardError` when the index has no entry for it."""
        if name not in self.shards:
            raise ShardError(f"{self.source}: weight_map has no entry for {name!r}", self.source)
        return self.shards[name]

    def names(self, prefix: str = "") -> list[str]:
        """The tensor names starting with ``prefix``, in index order."""
        return [name for name in self.shards if name.startswith(prefix)]


def _single_file_index(path: Path) -> ShardIndex:
    return ShardIndex(path, dict.fromkeys(_keys(path), path))


def _keys(shard: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(shard), framework="pt", device="cpu") as reader:
            return list(reader.keys())
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise ShardError(f"{shard}: cannot read tensors ({error})", shard) from error


def open_index(path: str | Path) -> ShardIndex:
    """The shard index of ``path``: a checkpoint directory (its ``model.safetensors.index.json``, else its
    single ``model.safetensors``), an index file, or one ``.safetensors`` file.

    Returns the index. Raises `ShardsNotFoundError` for a directory with neither file, `ShardError` for an
    unreadable index, one without a ``weight_map`` object, or a shard name that leaves the directory.
    """
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            return open_index(path / INDEX_FILE)
        if (path / SINGLE_WEIGHTS_FILE).is_file():
            return _single_file_index(path / SINGLE_WEIGHTS_FILE)
        raise ShardsNotFoundError(f"{path}: neither {INDEX_FILE} nor {SINGLE_WEIGHTS_FILE} found", path)
    if path.suffix == ".safetensors":
        return _single_file_index(path)
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise ShardsNotFoundError(f"{path}: safetensors index not found", path) from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShardError(f"{path}: cannot read the safetensors index: {error}", path) from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ShardError(f"{path}: the safetensors index has no weight_map object", path)
    shards: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise ShardError(f"{path}: weight_map entry {name!r} is not a file name", path)
        shards[name] = shard_path(path.parent, shard)
    return ShardIndex(path, shards)


def read_shard(shard: Path, select: Callable[[str], bool]) -> Iterator[tuple[str, Tensor]]:
    """Open ``shard`` once and yield ``(name, tensor)`` for every tensor ``select(name)`` accepts, in file
    order, one at a time (CPU, stored dtype). Raises `ShardError` when the file is missing or unreadable."""
    from safetensors import safe_open

    if not shard.is_file():
        raise ShardError(f"{shard}: safetensors shard not found", shard)
    try:
        with safe_open(str(shard), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if select(name):
                    yield name, reader.get_tensor(name)
    except ShardError:
        raise
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise ShardError(f"{shard}: cannot read tensors ({error})", shard) from error


def read_tensors(index: ShardIndex, names: Iterable[str]) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` for each of ``names``, opening each shard once (shards in path order).

    Raises `ShardError` when the index has no entry for a name, a shard is missing or unreadable, or does
    not hold a tensor the index assigns to it.
    """
    by_shard: dict[Path, set[str]] = {}
    for name in names:
        by_shard.setdefault(index.shard_of(name), set()).add(name)
    for shard, wanted in sorted(by_shard.items()):
        found: set[str] = set()
        for name, tensor in read_shard(shard, wanted.__contains__):
            found.add(name)
            yield name, tensor
        missing = sorted(wanted - found)
        if missing:
            raise ShardError(f"{shard}: no tensor named {missing[0]!r}", shard)
