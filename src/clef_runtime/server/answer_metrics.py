"""What the answers were, for ``/metrics`` and ``/status.json``: answers by model, head, classifier and
question type, how confident they were, how many were near ties, how many state tokens truncation dropped, and
whether the fused CUDA kernels run.

A question's confidence is its top option's probability (a ``noul``'s is that of ``true`` or ``false``,
whichever is higher); it is a near tie when the top two options are less than `NEAR_TIE_MARGIN` apart. The
probabilities read are the engine's unrounded (calibrated) ones, or the answer's rounded ones for an engine
that does not report them.

Labels are bounded: the model is the served one (never the request's free-text ``model``), the head is a
served head's name, the question type one of three, and the classifier a saved classifier's name ("" for a
request made without one). Classifier names are chosen by users: the first `MAX_CLASSIFIER_LABELS` names
answered keep their own series until the server restarts (a deleted classifier's counts stay, as counters
must not go back), later ones share `OTHER_CLASSIFIERS`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from clef_runtime.engine.card import EngineCard
from clef_runtime.engine.decision import Decision

__all__ = [
    "MAX_CLASSIFIER_LABELS",
    "NEAR_TIE_MARGIN",
    "OTHER_CLASSIFIERS",
    "AnswerMetrics",
    "FusedKernels",
    "fused_kernels_of",
]

NEAR_TIE_MARGIN = 0.05
"""An answer whose top two options' probabilities are less than this apart is a near tie."""
MAX_CLASSIFIER_LABELS = 100
"""Classifier names with series of their own (per server process); later ones share `OTHER_CLASSIFIERS`."""
OTHER_CLASSIFIERS = "_other"
"""The classifier label of the names past `MAX_CLASSIFIER_LABELS` (no classifier name starts with ``_``)."""

# Finer where answers mostly fall (0.5 to 1); a choice among n options can be as low as 1/n.
_CONFIDENCE_BUCKETS = (0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)
_ANSWER_LABELS = ("model", "head", "classifier", "type")


@dataclass(frozen=True)
class FusedKernels:
    """Whether the fused DeltaNet kernels (flash-linear-attention, causal-conv1d) run, and why not.

    ``reason``: ``in_use``; ``cpu`` (the CPU has kernels of its own); ``disabled`` (``--no-fused-kernels``);
    ``not_installed`` (a package of the ``cuda`` extra is missing: transformers falls back silently);
    ``unknown`` (the status could not be read); ``not_loaded`` (no model yet)."""

    in_use: bool
    device: str
    reason: str

    def as_api(self) -> dict[str, Any]:
        return {"in_use": self.in_use, "device": self.device, "reason": self.reason}


NOT_LOADED = FusedKernels(False, "", "not_loaded")


def fused_kernels_of(card: EngineCard, status: Callable[[], dict[str, Any]] | None = None) -> FusedKernels:
    """The fused-kernel status of an engine loaded as ``card`` says. ``status``: what is in place in this
    process (default `clef_runtime.model.fused.fused_kernels_status`, read only off CPU)."""
    device = card.device
    if device.split(":")[0] == "cpu":
        return FusedKernels(False, device, "cpu")
    if not card.options.fused_kernels:
        return FusedKernels(False, device, "disabled")
    if status is None:
        from clef_runtime.model.fused import fused_kernels_status

        status = fused_kernels_status
    try:
        active = status()["active"]
    except Exception:  # a status that cannot be read must not stop the server
        return FusedKernels(False, device, "unknown")
    if active and all(active.values()):
        return FusedKernels(True, device, "in_use")
    return FusedKernels(False, device, "not_installed")


def answer_probabilities(answer: dict[str, Any]) -> list[float]:
    """The option probabilities of one System One answer as it is sent (rounded): ``noul``'s two, a choice's
    or score's per option."""
    if answer.get("type") == "noul":
        p = float(answer["noul"])
        return [p, 1.0 - p]
    return [float(p) for p in answer.get("probabilities", {}).values()]


def confidence_and_margin(probabilities: Sequence[float]) -> tuple[float, float]:
    """The top probability and its margin over the second (the top itself for a single option)."""
    ordered = sorted(probabilities, reverse=True)
    if not ordered:
        return 0.0, 0.0
    return ordered[0], ordered[0] - (ordered[1] if len(ordered) > 1 else 0.0)


@dataclass
class _ClassifierFigures:
    answers: int = 0
    near_ties: int = 0
    confidence_sum: float = 0.0

    def as_api(self, classifier: str) -> dict[str, Any]:
        mean = round(self.confidence_sum / self.answers, 4) if self.answers else None
        return {
            "classifier": classifier or None,
            "answers": self.answers,
            "near_ties": self.near_ties,
            "mean_confidence": mean,
        }


class AnswerMetrics:
    """The answer metrics of one server (registered on its registry by `ServerMetrics`)."""

    def __init__(
        self,
        counter: Callable[..., Counter],
        gauge: Callable[..., Gauge],
        histogram: Callable[..., Histogram],
    ) -> None:
        self.answers = counter(
            "clef_answers",
            "Questions answered, by served model, head, saved classifier ('' for none) and question type.",
            list(_ANSWER_LABELS),
        )
        self.confidence = histogram(
            "clef_answer_confidence",
            "Confidence of each answered question: its top option's probability.",
            list(_ANSWER_LABELS),
            buckets=_CONFIDENCE_BUCKETS,
        )
        self.near_ties = counter(
            "clef_near_ties",
            f"Answered questions whose top two options are less than {NEAR_TIE_MARGIN} apart.",
            list(_ANSWER_LABELS),
        )
        self.truncated_tokens = counter(
            "clef_truncated_state_tokens", "State tokens dropped by truncation to fit the token limit."
        )
        self.fused_kernels = gauge(
            "clef_fused_kernels",
            "1 when the fused CUDA kernels (flash-linear-attention, causal-conv1d) run; 0 with the reason "
            "(cpu, disabled, not_installed, unknown).",
            ["device", "reason"],
        )
        self.fused = NOT_LOADED
        self.model = ""
        self._lock = threading.Lock()
        self._by_classifier: dict[str, _ClassifierFigures] = {}

    def model_loaded(self, model: str, fused: FusedKernels) -> None:
        """Note the served model's name (the answers' ``model`` label) and its fused-kernel status."""
        self.model = model
        self.fused = fused
        self.fused_kernels.clear()
        self.fused_kernels.labels(fused.device, fused.reason).set(1 if fused.in_use else 0)

    def _classifier_label(self, classifier: str) -> str:
        # Called under the lock: the first names keep their own series, later ones share one.
        if classifier in self._by_classifier or len(self._by_classifier) < MAX_CLASSIFIER_LABELS:
            return classifier
        return OTHER_CLASSIFIERS

    def observe(self, decision: Decision, classifier: str) -> None:
        """Record every answer of ``decision``, asked through ``classifier`` ("" for none)."""
        head = decision.head.name if decision.head is not None else ""
        answers = list(decision.answers.values())
        unrounded = decision.probabilities
        if unrounded is None or len(unrounded) != len(answers):
            unrounded = [answer_probabilities(answer) for answer in answers]
        with self._lock:
            label = self._classifier_label(classifier)
            figures = self._by_classifier.setdefault(label, _ClassifierFigures())
            for answer, probabilities in zip(answers, unrounded, strict=True):
                labels = (self.model, head, label, str(answer.get("type", "")))
                confidence, margin = confidence_and_margin(probabilities)
                self.answers.labels(*labels).inc()
                self.confidence.labels(*labels).observe(confidence)
                figures.answers += 1
                figures.confidence_sum += confidence
                if margin < NEAR_TIE_MARGIN:
                    self.near_ties.labels(*labels).inc()
                    figures.near_ties += 1

    def summary(self) -> list[dict[str, Any]]:
        """Per classifier label (None for requests without one), the answers, near ties and mean
        confidence since start, in name order (None first)."""
        with self._lock:
            figures = sorted(self._by_classifier.items())
            return [one.as_api(name) for name, one in figures]
