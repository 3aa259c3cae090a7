"""What a served head is, as records that cross process boundaries (the server, a Ray replica, a test's fake
engine): its identity (`HeadIdentity`: name and digest), its card (`HeadInfo`: what ``GET /v1/heads``
lists) and the errors of naming a head that is not there (`HeadNotLoadedError`) or no longer the one
pinned (`HeadChangedError`).

A head's digest is what "the same head" means: the sha256 of a short manifest listing the sha256 of its
weights file (``joint_head.safetensors``), of its config (``joint_head_config.json``) and of the calibration
applied to its answers, if any. Two heads with one digest compute the same probabilities; a changed byte in
any of the three changes it. It is computed from the files, so the release's head (in the checkpoint
directory) and a tuned head (``clef tune --out DIR``) are named the same way. No torch here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from clef_runtime.protocol.errors import ClefError

__all__ = [
    "DIGEST_SHORT",
    "HeadChangedError",
    "HeadError",
    "HeadIdentity",
    "HeadInfo",
    "HeadNotLoadedError",
    "HeadRefusedError",
    "HeadSource",
    "check_pin",
    "file_sha256",
    "head_digest",
]

#: Hex digits of a digest in ``X-Clef-Head`` and log lines (48 bits: enough to tell heads apart by eye).
DIGEST_SHORT = 12

HeadSource = Literal["release", "--head", "api"]
"""Where a served head came from: the checkpoint, a ``--head`` at startup, or ``POST /v1/heads``."""


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks (a 9B release's head file is half a gigabyte)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def head_digest(weights: Path, config: Path, calibration_sha256: str | None) -> str:
    """A head's identity (see the module docstring): the sha256 of ``weights <sha256>\nconfig
    <sha256>\n[calibration <sha256>\n]``, where the last is the sha256 of the calibration applied to its
    answers (None: none)."""
    manifest = f"weights {file_sha256(weights)}\nconfig {file_sha256(config)}\n"
    if calibration_sha256 is not None:
        manifest += f"calibration {calibration_sha256}\n"
    return hashlib.sha256(manifest.encode("ascii")).hexdigest()


@dataclass(frozen=True)
class HeadIdentity:
    """Which head computed an answer: its name (the model's name for the default head) and digest."""

    name: str
    digest: str

    @property
    def label(self) -> str:
        """``name@digest12``: the ``X-Clef-Head`` header and log lines."""
        return f"{self.name}@{self.digest[:DIGEST_SHORT]}"

    def as_api(self) -> dict[str, str]:
        """``x_head`` in response bodies."""
        return {"name": self.name, "digest": self.digest}


@dataclass(frozen=True)
class HeadInfo:
    """A served head as ``GET /v1/heads`` lists it."""

    name: str
    """What a request's ``model`` says to pick it (the model's own name for the default head)."""
    digest: str
    default: bool
    """True for the head that answers every other ``model`` (the release's, or a bare ``--head DIR``)."""
    source: HeadSource
    path: str | None
    """The directory it was loaded from (the checkpoint's, for the release head)."""
    calibration: Mapping[str, Any] | None
    """The calibration applied to its answers (label, file, sha256, temperatures), or None."""
    loaded_at: float
    """Unix time it was loaded."""

    @property
    def identity(self) -> HeadIdentity:
        return HeadIdentity(self.name, self.digest)

    def as_api(self) -> dict[str, Any]:
        """Its JSON card (``GET /v1/heads``, ``x_head`` of ``/v1/models``)."""
        card = {field.name: getattr(self, field.name) for field in fields(self)}  # in field order
        card["calibration"] = dict(self.calibration) if self.calibration is not None else None
        return card


class HeadError(ClefError):
    """A head cannot answer as a request or a call asks (``error_type`` names which way)."""


class HeadNotLoadedError(HeadError):
    """The head a request or a saved classifier names is not served (never loaded, or unloaded)."""

    error_type = "head_not_loaded"

    def __init__(self, name: str, served: Sequence[str] = ()) -> None:
        self.name = name
        self.served = tuple(served)
        """The names of the heads served now."""
        super().__init__(
            f"head {name!r} is not loaded; the heads served are {', '.join(repr(n) for n in self.served)} "
            "(GET /v1/heads)"
        )


class HeadChangedError(HeadError):
    """The head a request pins (``x_head_digest``) is served with other weights."""

    error_type = "head_changed"

    def __init__(self, name: str, pinned: str, served: str) -> None:
        self.name = name
        self.pinned = pinned
        self.served = served
        super().__init__(
            f"head {name!r} changed: the digest pinned is {pinned}, the head served now is {served}"
        )


class HeadRefusedError(HeadError):
    """A head cannot be loaded or unloaded as asked (``POST`` / ``DELETE /v1/heads``): ``field`` is the
    request's field at fault (``name`` or ``path``); ``conflict`` when the request is valid but the served
    set forbids it (a name taken, the default head, heads fixed)."""

    error_type = "invalid_head"

    def __init__(self, field: str, message: str, *, conflict: bool = False) -> None:
        self.field = field
        self.conflict = conflict
        super().__init__(message)


def check_pin(heads: Sequence[HeadInfo], model: str | None, pinned: str | None) -> None:
    """For an engine whose heads are fixed (a scale-out ingress): refuse a request pinning a head
    (``x_head_digest``) whose ``model`` is no served head (`HeadNotLoadedError`) or whose digest differs
    (`HeadChangedError`); a request without a pin passes."""
    if pinned is None:
        return
    default = next(info for info in heads if info.default)
    by_name = {info.name: info for info in heads}
    info = by_name.get(model) if model is not None else default
    if info is None:
        raise HeadNotLoadedError(model or "", tuple(by_name))
    if not info.digest.startswith(pinned):
        raise HeadChangedError(info.name, pinned, info.digest)
