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
    """Whether the fused DeltaNet kernels (flash-linear-attention, causal-conv1d) run, and why not: read from
    the calls counted (`clef_runtime.model.fused.fused_kernels_status`), not from what is installed.

    ``reason``: ``in_use`` (fused calls counted, no reference call); ``partial`` (both: a fused kernel is
    missing for some functions); ``fallback`` (all installed, yet only reference calls counted);
    ``not_installed`` (a package of the ``cuda`` extra is missing: transformers falls back silently);
    ``no_calls`` (all installed, nothing run yet); ``disabled`` (``--no-fused-kernels``); ``cpu`` (the CPU
    has kernels of its own); ``replicas`` (the model runs in other processes, ``--ray``: not counted here);
    ``unknown`` (the status could not be read); ``not_loaded`` (no model yet). ``calls``: the DeltaNet calls
    counted in this process, ``{"fused": n, "reference": n}`` (None where not read); ``conv``: the causal conv
    in place (``causal_conv1d``, ``fla``, ``reference``; None where not read)."""

    in_use: bool
    device: str
    reason: str
    calls: dict[str, int] | None = None
    conv: str | None = None

    def as_api(self) -> dict[str, Any]:
        return {
            "in_use": self.in_use,
            "device": self.device,
            "reason": self.reason,
            "calls": dict(self.calls) if self.calls is not None else None,
            "conv": self.conv,
        }


NOT_LOADED = FusedKernels(False, "", "not_loaded")


def _reason_of(status: dict[str, Any], calls: dict[str, int]) -> str:
    """The reason of a status read on an accelerator with the fused kernels on."""
    if calls["fused"]:
        return "partial" if calls["reference"] else "in_use"
    if not all(status["active"].values()):
        return "not_installed"
    return "fallback" if calls["reference"] else "no_calls"


def fused_kernels_of(
    card: EngineCard, status: Callable[[], dict[str, Any]] | None = None, *, in_process: bool = True
) -> FusedKernels:
    """The fused-kernel status, now, of an engine loaded as ``card`` says. ``status``: what is in place and
    was called in this process (default `clef_runtime.model.fused.fused_kernels_status`, read only off CPU
    and when the engine runs ``in_process``)."""
    device = card.device
    if device.split(":")[0] == "cpu":
        return FusedKernels(False, device, "cpu")
    if not in_process:
        return FusedKernels(False, device, "replicas")
    if status is None:
        from clef_runtime.model.fused import fused_kernels_status

        status = fused_kernels_status
    try:
        read = status()
        calls = {
            kind: sum(int(counts[kind]) for counts in read["calls"].values())
            for kind in ("fused", "reference")
        }
        reason = _reason_of(read, calls) if card.options.fused_kernels else "disabled"
        conv = str(read["conv"])
    except Exception:  # a status that cannot be read must not stop the server
        return FusedKernels(False, device, "unknown" if card.options.fused_kernels else "disabled")
    return FusedKernels(reason == "in_use", device, reason, calls, conv)


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
            "1 when the fused CUDA kernels (flash-linear-attention, causal-conv1d) run, from the calls "
            "counted; 0 with the reason (partial, fallback, not_installed, no_calls, disabled, cpu, "
            "replicas, unknown).",
            ["device", "reason"],
        )
        self._fused_source: Callable[[], FusedKernels] = lambda: NOT_LOADED
        self.model = ""
        self._lock = threading.Lock()
        self._by_classifier: dict[str, _ClassifierFigures] = {}

    def model_loaded(self, model: str, fused: Callable[[], FusedKernels]) -> None:
        """Note the served model's name (the answers' ``model`` label) and where its fused-kernel status is
        read (``fused``, called on every `fused_now`)."""
        self.model = model
        self._fused_source = fused
        self.fused_now()

    def fused_now(self) -> FusedKernels:
        """The fused-kernel status as the counts say now; the ``clef_fused_kernels`` gauge is set to it (one
        series: the reason's, its label values from a fixed set)."""
        fused = self._fused_source()
        with self._lock:
            self.fused_kernels.clear()
            self.fused_kernels.labels(fused.device, fused.reason).set(1 if fused.in_use else 0)
        return fused

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
