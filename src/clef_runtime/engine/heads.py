"""Many heads on one backbone: the release's joint schema head plus tuned heads (``clef tune``) served next
to it, each a name for one set of weights (its digest, `clef_runtime.engine.head_records`).

The backbone's rows of a request do not depend on the head, so every head shares the backbone, the lexical
table and the state cache: asking a known state through another head is a state-cache hit, and one engine
step may complete rows of several heads (each head scores its own rows).

``--head [NAME=]DIR`` (repeatable; ``CLEF_HEAD``, comma-separated; ``Clef.load(head=[...])``):
``NAME=DIR`` serves the head in ``DIR`` under ``NAME``: a request whose top-level ``model`` is ``NAME`` is
answered by it, any other ``model`` by the default head. A bare ``DIR`` replaces the default head (``clef
decide --head DIR``). A head directory holds ``joint_head.safetensors`` + ``joint_head_config.json`` in the
release layout, and optionally the ``calibration.json`` that ``clef tune --calibrate`` refits for it: that
head's answers are then calibrated with it (instead of ``--calibration``, which applies to the heads without
their own).

Heads are added and removed at run time (`HeadSet.add`, `HeadSet.remove`: ``POST`` / ``DELETE /v1/heads``).
A request's head is resolved once, when it is prepared (`HeadSet.resolve`), and travels with it: a request
admitted before its head is unloaded finishes on it, and one prepared after is refused
(`HeadNotLoadedError`), never answered by the default head. Loading reads the files and moves the weights to
the device without the model lock, so other requests go on meanwhile; the set changes under its own lock.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from clef_runtime.engine.calibration import Calibration, CalibrationError
from clef_runtime.engine.head_records import (
    HeadChangedError,
    HeadIdentity,
    HeadInfo,
    HeadNotLoadedError,
    HeadRefusedError,
    HeadSource,
    head_digest,
)
from clef_runtime.model.head import HeadLoadError, JointSchemaHead, read_head_config
from clef_runtime.options import HeadSpec, OptionsError
from clef_runtime.release import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE

__all__ = [
    "HEAD_CALIBRATION_FILE",
    "HeadSet",
    "ServedHead",
    "check_head_names",
    "check_head_specs",
    "load_head",
]

#: The calibration a head directory may carry (``clef tune --calibrate`` writes it).
HEAD_CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True, eq=False)
class ServedHead:
    """A head the engine answers with."""

    name: str
    """What a request's ``model`` says to pick it; the model's own name for the default head."""
    head: JointSchemaHead
    calibration: Calibration | None
    path: Path
    """Its directory (the checkpoint's, for the release head)."""
    digest: str
    """Its identity (`clef_runtime.engine.head_records.head_digest`)."""
    source: HeadSource
    default: bool
    loaded_at: float

    @property
    def identity(self) -> HeadIdentity:
        return HeadIdentity(self.name, self.digest)

    def info(self) -> HeadInfo:
        """Its card (``GET /v1/heads``)."""
        return HeadInfo(
            name=self.name,
            digest=self.digest,
            default=self.default,
            source=self.source,
            path=str(self.path),
            calibration=self.calibration.describe() if self.calibration is not None else None,
            loaded_at=self.loaded_at,
        )


class HeadSet:
    """The default head and the named ones; `resolve` picks a request's. Thread-safe."""

    def __init__(self, default: ServedHead, named: Sequence[ServedHead] = ()) -> None:
        self.default = default
        self._named: dict[str, ServedHead] = {served.name: served for served in named}
        self._unloaded: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        specs: Sequence[HeadSpec],
        *,
        model_name: str,
        release_dir: Path,
        release_head: JointSchemaHead,
        calibration: Calibration | None,
        device: torch.device,
        release_digest: str | None = None,
    ) -> HeadSet:
        """The release's head (replaced by a bare ``DIR``) plus every named head, on ``device``. A head
        with its own ``calibration.json`` uses it; the others use ``calibration`` (``--calibration``).
        ``release_digest``: the release head's digest when it has no files in ``release_dir`` (a head built
        in memory); None: `head_digest` of its files.

        Raises `OptionsError` naming ``--head`` and the file for a head that cannot be loaded (missing or
        malformed files, a ``hidden_size`` that is not the backbone's, a bad calibration)."""
        check_head_names(specs, model_name)
        default = ServedHead(
            name=model_name,
            head=release_head,
            calibration=calibration,
            path=release_dir,
            digest=release_digest
            or head_digest(
                release_dir / HEAD_WEIGHTS_FILE,
                release_dir / HEAD_CONFIG_FILE,
                calibration_sha256(calibration),
            ),
            source="release",
            default=True,
            loaded_at=time.time(),
        )
        named: list[ServedHead] = []
        for spec in specs:
            try:
                served = load_head(
                    spec.name or model_name,
                    spec.path,
                    hidden_size=release_head.hidden_size,
                    calibration=calibration,
                    device=device,
                    source="--head",
                    default=spec.name is None,
                )
            except (HeadLoadError, CalibrationError) as exc:
                raise OptionsError(f"{_where(spec)}: {exc}") from None
            if spec.name is None:
                default = served
            else:
                named.append(served)
        return cls(default, named)

    # ------------------------------------------------------------------------------------------ lookups

    def resolve(self, model: str | None, pinned_digest: str | None = None) -> ServedHead:
        """The head that answers a request whose top-level ``model`` is ``model``: a named head by its name,
        the default head by the model's name or any other name (clients send ``jev-latest`` or an OpenAI
        model name). Raises `HeadNotLoadedError` for a head unloaded at run time, and, when the request pins
        a digest (``x_head_digest``, a prefix of at least 12 hex digits), for a name that is no served head
        at all and `HeadChangedError` for a head whose digest differs."""
        with self._lock:
            served = self._named.get(model) if model is not None else None
            if served is None and model is not None and model in self._unloaded:
                raise HeadNotLoadedError(model, self._names_locked())
            if served is None:
                if pinned_digest is not None and model is not None and model != self.default.name:
                    raise HeadNotLoadedError(model, self._names_locked())
                served = self.default
        if pinned_digest is not None and not served.digest.startswith(pinned_digest):
            raise HeadChangedError(served.name, pinned_digest, served.digest)
        return served

    def for_model(self, model: str | None) -> ServedHead:
        """The head of a request prepared without one (a scale-out replica's, whose heads never change):
        the named head ``model`` names, else the default head."""
        with self._lock:
            served = self._named.get(model) if model is not None else None
        return served if served is not None else self.default

    def names(self) -> tuple[str, ...]:
        """Every served head's name, the default head's first."""
        with self._lock:
            return self._names_locked()

    def _names_locked(self) -> tuple[str, ...]:
        return (self.default.name, *self._named)

    def served(self) -> tuple[ServedHead, ...]:
        """Every served head, the default head first."""
        with self._lock:
            return (self.default, *self._named.values())

    def infos(self) -> tuple[HeadInfo, ...]:
        """Every served head's card, the default head first."""
        return tuple(served.info() for served in self.served())

    # ------------------------------------------------------------------------------------------ changes

    def add(self, served: ServedHead) -> None:
        """Serve ``served`` under its name. Raises `HeadRefusedError` when the name is taken (the model's own
        name included): a name means one set of weights, so replacing one is an unload and a load."""
        with self._lock:
            self._check_free_locked(served.name)
            self._named[served.name] = served
            self._unloaded.discard(served.name)

    def check_free(self, name: str) -> None:
        """Raise `HeadRefusedError` (a conflict) when ``name`` is served already (checked before loading a
        head's weights, and again when adding it)."""
        with self._lock:
            self._check_free_locked(name)

    def _check_free_locked(self, name: str) -> None:
        if name in self._names_locked():
            raise HeadRefusedError(
                "name",
                f"a head named {name!r} is already served; unload it first (DELETE /v1/heads/{name}) or "
                "choose another name",
                conflict=True,
            )

    def remove(self, name: str) -> ServedHead:
        """Stop serving the named head ``name`` and return it; requests already prepared with it finish on
        it, and later ones naming it get `HeadNotLoadedError`. Raises `HeadNotLoadedError` for a name not
        served and `HeadRefusedError` for the default head (it answers every other model name)."""
        with self._lock:
            if name == self.default.name:
                raise HeadRefusedError(
                    "name",
                    f"{name!r} is the default head (it answers every request that names no other head); it "
                    "cannot be unloaded",
                    conflict=True,
                )
            served = self._named.pop(name, None)
            if served is None:
                raise HeadNotLoadedError(name, self._names_locked())
            self._unloaded.add(name)
            return served


def calibration_sha256(calibration: Calibration | None) -> str | None:
    """What a head's digest records of the calibration applied to its answers: its file's sha256 (or, for
    one built in memory, of its temperatures as canonical JSON); None without one."""
    if calibration is None:
        return None
    if calibration.digest:
        return calibration.digest
    canonical = {"temperatures": dict(calibration.temperatures), "questions": dict(calibration.questions)}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode("utf-8")).hexdigest()


def _where(spec: HeadSpec) -> str:
    return f"--head {spec.name + '=' if spec.name else ''}{spec.path}"


def check_head_names(specs: Sequence[HeadSpec], model_name: str) -> None:
    """Refuse a ``--head`` named as the model: that name is the release head's. Raises `OptionsError`."""
    for spec in specs:
        if spec.name == model_name:
            raise OptionsError(
                f"{_where(spec)}: {model_name!r} is the model's own name (it picks the release head); give "
                "the tuned head another name"
            )


def check_head_specs(specs: Sequence[HeadSpec]) -> None:
    """Cheap checks before a model loads: each head's directory, config, weights file and calibration.
    Raises `OptionsError` naming the ``--head`` value and the file."""
    for spec in specs:
        where = _where(spec)
        if not spec.path.is_dir():
            raise OptionsError(f"{where}: not a directory")
        try:
            check_head_dir(spec.path)
        except (HeadLoadError, CalibrationError) as exc:
            raise OptionsError(f"{where}: {exc}") from None


def check_head_dir(path: Path) -> None:
    """Raise `HeadLoadError` (or ``CalibrationError``) unless ``path`` is a head directory: its config reads,
    its weights file exists, its own calibration (if any) reads."""
    if not path.is_dir():
        raise HeadLoadError(path, "not a directory")
    read_head_config(path / HEAD_CONFIG_FILE)
    if not (path / HEAD_WEIGHTS_FILE).is_file():
        raise HeadLoadError(path / HEAD_WEIGHTS_FILE, "not found")
    own = path / HEAD_CALIBRATION_FILE
    if own.is_file():
        Calibration.load(own)


def load_head(
    name: str,
    path: Path,
    *,
    hidden_size: int,
    calibration: Calibration | None,
    device: torch.device,
    source: HeadSource,
    default: bool = False,
) -> ServedHead:
    """Load the head in ``path`` (on ``device``) to serve as ``name``. Its own ``calibration.json`` wins over
    ``calibration``. Raises `HeadLoadError` (missing or malformed files, a
    ``hidden_size`` that is not the backbone's) or ``CalibrationError``."""
    check_head_dir(path)
    head = JointSchemaHead.from_files(path, device=device)
    if head.hidden_size != hidden_size:
        raise HeadLoadError(
            path / HEAD_CONFIG_FILE,
            f"the head reads hidden_size {head.hidden_size} but the backbone's is {hidden_size} (tuned for "
            "another model?)",
        )
    own = path / HEAD_CALIBRATION_FILE
    if own.is_file():
        calibration = Calibration.load(own)
    return ServedHead(
        name=name,
        head=head,
        calibration=calibration,
        path=path,
        digest=head_digest(
            path / HEAD_WEIGHTS_FILE, path / HEAD_CONFIG_FILE, calibration_sha256(calibration)
        ),
        source=source,
        default=default,
        loaded_at=time.time(),
    )
