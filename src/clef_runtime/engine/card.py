"""``EngineCard``: what an engine is, as one immutable record (no torch).

The card says which model an engine serves and how (options, device, weights, compute dtype, step budget,
calibration): ``/v1/models``, ``/status.json`` and the pages read it. The real engine makes it once at load;
a Ray model replica sends its card whole (pickled) to the ingress, whose engine then describes the same
model; the tests' fake engine makes one of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from clef_runtime.model.checkpoint import ModelCard
from clef_runtime.options import EngineOptions

__all__ = ["CardedEngine", "EngineCard", "ModelCard"]


@dataclass(frozen=True)
class EngineCard:
    """An engine's identity: the model it serves and the settings it computes with."""

    model: ModelCard
    """The model's name, description and release date (``/v1/models``), and whether it is untrained."""
    options: EngineOptions
    """The options the engine was loaded with."""
    device: str
    """Where the model runs (``cpu``, ``cuda:0``): ``/status.json``."""
    weight_mode: str
    """How the weights are stored and computed (``fp32``, ``bfloat16``, ``bf16-storage``, ``int8``...)."""
    compute_dtype: str
    """The backbone's compute dtype, ``fp32`` or ``bf16`` (``/v1/models``, ``/status.json``, the log)."""
    step_tokens: int
    """The token budget of one engine step (``--max-step-tokens``, else the device's default)."""
    calibration: Mapping[str, Any] | None = None
    """The calibration applied to answers (label, file, sha256, temperatures: ``/v1/models``), or None."""

    @property
    def max_length(self) -> int:
        """The token limit of one request (``options.max_length``)."""
        return self.options.max_length


class CardedEngine:
    """The members of the engine contract that an engine reads from its card: every engine sets ``card``
    and inherits these."""

    card: EngineCard

    @property
    def name(self) -> str:
        """The model name answered in ``model`` (``card.model.name``)."""
        return self.card.model.name

    @property
    def step_tokens(self) -> int:
        """The token budget of one engine step (``card.step_tokens``)."""
        return self.card.step_tokens
