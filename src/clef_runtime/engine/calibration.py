"""Temperature calibration of answers: the ``calibration.json`` that ``clef calibrate`` writes and
``--calibration FILE`` (``CLEF_CALIBRATION``, ``Clef.load(..., calibration=path)``) applies.

A question's calibrated probabilities are ``softmax(ln p / T)`` over its options, with ``T`` the question
id's temperature when the file has one, else its type's (noul / choice / score), else 1 (unchanged). T > 1
flattens the distribution (less confident), T < 1 sharpens it; the order of the options never changes, so
neither does the argmax. The engine applies it before the answer's ``confidence``, ``score`` and rounding are
computed. Standard library only: the CLI validates a file without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_runtime.options import OptionsError

__all__ = [
    "CALIBRATION_VERSION",
    "QUESTION_TYPES",
    "Calibration",
    "CalibrationError",
    "temperature_scale",
]

CALIBRATION_VERSION = 1
QUESTION_TYPES = ("noul", "choice", "score")


class CalibrationError(OptionsError):
    """A calibration file is missing, unreadable or malformed; the message names the file and the field.

    An `OptionsError`, so the CLI reports it in one line with exit status 2."""


def temperature_scale(probs: Sequence[float], temperature: float) -> list[float]:
    """``softmax(ln p / T)`` of one question's probabilities, in the same order.

    A probability of exactly 0 stays 0 (``ln 0 = -inf``). Returns ``probs`` as floats unchanged for T == 1.
    """
    if temperature == 1.0:
        return [float(p) for p in probs]
    logs = [math.log(p) / temperature if p > 0 else -math.inf for p in probs]
    top = max(logs)
    if top == -math.inf:  # all zero: nothing to rescale (never from a softmax)
        return [float(p) for p in probs]
    weights = [math.exp(x - top) for x in logs]
    total = sum(weights)
    return [w / total for w in weights]


def _temperature(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CalibrationError(f"{where} must be a number, got {json.dumps(value)}")
    if not math.isfinite(value) or value <= 0:
        raise CalibrationError(f"{where} must be a positive finite number, got {value}")
    return float(value)


@dataclass(frozen=True)
class Calibration:
    """Temperatures per question type and per question id, loaded from a calibration file."""

    temperatures: Mapping[str, float]
    """Question type -> T (types not listed: 1)."""
    questions: Mapping[str, float] = field(default_factory=dict)
    """Question id -> T (wins over its type's)."""
    name: str = "calibration"
    """The file name (for ``x_calibration`` and ``/v1/models``)."""
    digest: str = ""
    """sha256 of the file's bytes (hex)."""
    fitted_on: Mapping[str, Any] = field(default_factory=dict)
    """What the file says it was fitted on (``clef calibrate`` writes the case count and the model)."""

    @property
    def label(self) -> str:
        """``NAME@sha256:0123456789ab``: which calibration answered (the ``x_calibration`` of responses)."""
        return f"{self.name}@sha256:{self.digest[:12]}"

    def temperature(self, question_id: str, question_type: str) -> float:
        """The temperature of a question: its id's, else its type's, else 1."""
        found = self.questions.get(question_id)
        if found is not None:
            return found
        return self.temperatures.get(question_type, 1.0)

    def apply(self, question_id: str, question_type: str, probs: Sequence[float]) -> list[float]:
        """One question's calibrated probabilities (same option order): ``softmax(ln p / T)``."""
        return temperature_scale(probs, self.temperature(question_id, question_type))

    def describe(self) -> dict[str, Any]:
        """What ``/v1/models`` shows: the label, the file name, the digest and the temperatures."""
        return {
            "label": self.label,
            "file": self.name,
            "sha256": self.digest,
            "temperatures": dict(self.temperatures),
            "questions": dict(self.questions),
        }

    def to_json(self, **extra: Any) -> dict[str, Any]:
        """The file's JSON form (``version``, ``temperatures``, ``questions``, ``fitted_on``) plus ``extra``
        top-level keys (``nll_before``, ``nll_after``)."""
        return {
            "version": CALIBRATION_VERSION,
            "temperatures": dict(self.temperatures),
            "questions": dict(self.questions),
            "fitted_on": dict(self.fitted_on),
            **extra,
        }

    @classmethod
    def from_json(cls, data: Any, *, name: str = "calibration", digest: str = "") -> Calibration:
        """Validate a decoded calibration file. Raises `CalibrationError` naming the bad field."""
        if not isinstance(data, dict):
            raise CalibrationError("the file must hold a JSON object")
        version = data.get("version")
        if version != CALIBRATION_VERSION:
            raise CalibrationError(f"version must be {CALIBRATION_VERSION}, got {json.dumps(version)}")
        temperatures = data.get("temperatures")
        if not isinstance(temperatures, dict):
            raise CalibrationError("temperatures must be an object {noul|choice|score: T}")
        by_type = {}
        for key, value in temperatures.items():
            if key not in QUESTION_TYPES:
                raise CalibrationError(f"temperatures.{key}: unknown question type (noul, choice or score)")
            by_type[key] = _temperature(value, f"temperatures.{key}")
        questions = data.get("questions", {})
        if not isinstance(questions, dict):
            raise CalibrationError("questions must be an object {question_id: T}")
        by_id = {str(key): _temperature(value, f"questions.{key}") for key, value in questions.items()}
        fitted_on = data.get("fitted_on", {})
        if not isinstance(fitted_on, dict):
            raise CalibrationError("fitted_on must be an object")
        return cls(temperatures=by_type, questions=by_id, name=name, digest=digest, fitted_on=fitted_on)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read and validate a calibration file. Raises `CalibrationError` (one line naming the file and,
        for a malformed one, the field)."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise CalibrationError(f"--calibration {path}: cannot read: {exc.strerror or exc}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"--calibration {path}: not a JSON file: {exc}") from None
        try:
            return cls.from_json(data, name=path.name, digest=hashlib.sha256(raw).hexdigest())
        except CalibrationError as exc:
            raise CalibrationError(f"--calibration {path}: {exc}") from None
