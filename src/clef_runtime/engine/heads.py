"""Many heads on one backbone: the release's joint schema head plus tuned heads (``clef tune``) served next
to it.

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
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clef_runtime.engine.calibration import Calibration
from clef_runtime.model.head import HeadLoadError, JointSchemaHead, read_head_config
from clef_runtime.options import HeadSpec, OptionsError
from clef_runtime.release import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE

__all__ = ["HEAD_CALIBRATION_FILE", "HeadSet", "ServedHead", "check_head_specs"]

#: The calibration a head directory may carry (``clef tune --calibrate`` writes it).
HEAD_CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class ServedHead:
    """A head the engine answers with: ``name`` None for the default head."""

    name: str | None
    head: JointSchemaHead
    calibration: Calibration | None
    path: Path | None
    """Its directory (None: the release's own head, in the checkpoint)."""
    sha256: str | None = None
    """Of its weights file (None for the release's head): which head answered, for ``/v1/models``."""

    def card(self) -> dict[str, Any]:
        """What ``/v1/models`` says about a tuned head."""
        return {
            "path": str(self.path) if self.path is not None else None,
            "sha256": self.sha256,
            "calibration": self.calibration.describe() if self.calibration is not None else None,
        }


class HeadSet:
    """The default head and the named ones; `for_model` picks a request's."""

    def __init__(self, default: ServedHead, named: Mapping[str, ServedHead] | None = None) -> None:
        self.default = default
        self.named: dict[str, ServedHead] = dict(named or {})

    @classmethod
    def load(
        cls,
        specs: Sequence[HeadSpec],
        *,
        release_head: JointSchemaHead,
        calibration: Calibration | None,
        device: torch.device,
    ) -> HeadSet:
        """The release's head (replaced by a bare ``DIR``) plus every named head, on ``device``. A head
        with its own ``calibration.json`` uses it; the others use ``calibration`` (``--calibration``).

        Raises `OptionsError` naming ``--head`` and the file for a head that cannot be loaded (missing or
        malformed files, a ``hidden_size`` that is not the backbone's, a bad calibration)."""
        default = ServedHead(None, release_head, calibration, None)
        named: dict[str, ServedHead] = {}
        for spec in specs:
            served = _load_head(spec, release_head.hidden_size, calibration, device)
            if spec.name is None:
                default = served
            else:
                named[spec.name] = served
        return cls(default, named)

    def for_model(self, model: str | None) -> ServedHead:
        """The head that answers a request whose top-level ``model`` is ``model``."""
        if model is not None:
            served = self.named.get(model)
            if served is not None:
                return served
        return self.default

    def cards(self) -> dict[str, dict[str, Any]]:
        """Every named head's card, by name (``/v1/models``)."""
        return {name: served.card() for name, served in self.named.items()}


def _where(spec: HeadSpec) -> str:
    return f"--head {spec.name + '=' if spec.name else ''}{spec.path}"


def check_head_specs(specs: Sequence[HeadSpec]) -> None:
    """Cheap checks before a model loads: each head's directory, config, weights file and calibration.
    Raises `OptionsError` naming the ``--head`` value and the file."""
    for spec in specs:
        where = _where(spec)
        if not spec.path.is_dir():
            raise OptionsError(f"{where}: not a directory")
        try:
            read_head_config(spec.path / HEAD_CONFIG_FILE)
        except HeadLoadError as exc:
            raise OptionsError(f"{where}: {exc}") from None
        if not (spec.path / HEAD_WEIGHTS_FILE).is_file():
            raise OptionsError(f"{where}: {spec.path / HEAD_WEIGHTS_FILE} not found")
        own = spec.path / HEAD_CALIBRATION_FILE
        if own.is_file():
            Calibration.load(own)


def _load_head(
    spec: HeadSpec, hidden_size: int, calibration: Calibration | None, device: torch.device
) -> ServedHead:
    where = _where(spec)
    if not spec.path.is_dir():
        raise OptionsError(f"{where}: not a directory")
    try:
        head = JointSchemaHead.from_files(spec.path, device=device)
    except HeadLoadError as exc:
        raise OptionsError(f"{where}: {exc}") from None
    if head.hidden_size != hidden_size:
        raise OptionsError(
            f"{where}: the head reads hidden_size {head.hidden_size} but the backbone's is {hidden_size} "
            "(tuned for another model?)"
        )
    own = spec.path / HEAD_CALIBRATION_FILE
    head_calibration = Calibration.load(own) if own.is_file() else calibration
    digest = hashlib.sha256((spec.path / HEAD_WEIGHTS_FILE).read_bytes()).hexdigest()
    return ServedHead(spec.name, head, head_calibration, spec.path, digest)
