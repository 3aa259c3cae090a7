"""The ``confidence`` of choice and score answers, in the three definitions clients rely on.

``confidence`` means different things to different clients, and thresholds tuned against one definition
give different decisions under another, so the engine offers each (``--confidence``, default ``seed``).
All are computed from the unrounded probabilities of one question (in level order for a score); the answer
rounds the result to 4 decimals like every other number. Noul answers carry no confidence in any of them
(the System One contract has none for noul).

``seed`` - the top probability: the choice's probability, or the largest level probability of a score.
    This is Clef's reference code (``systemone_answer`` in the model release) and this project's seed.

``typesafe`` - TypeSafe's chance-corrected definitions, from the public System One adapter library
    (github.com/typesafe-ai/system-one-adapter-python, ``utils/confidence_metrics.py``), probabilities
    normalised to sum 1 first (uniform if they sum to 0), 1.0 for a single option:

    * choice: ``(m - 1/n) / (1 - 1/n)`` with m the top probability and n the number of options: 0 for a
      uniform answer, 1 for a certain one;
    * score: ``max(0, 1 - sum_i p_i * |i - k| / D)`` with k the modal level (first maximum) and
      ``D = (1/n) * sum_i |i - (n - 1)/2|`` the mean absolute deviation of a uniform answer from the
      middle level: probability mass far from the mode lowers it.

``workers-ai`` - what Cloudflare's hosted Workers AI model returns: ``(n * sum_i p_i^2 - 1) / (n - 1)``
    (0 for a uniform answer, 1 for a certain one). Observed on a live ``@cf/cloudflare/clef-flash`` answer,
    published in github.com/sidmohan0/browser-use-clef-flash ``docs/clef-verification.md``: probabilities
    (0.8653, 0.0694, 0.0653) came with confidence 0.6367, and (0.9858, 0.0142) with 0.9442 (0.9440 from the
    rounded probabilities). Only choice answers were observed; the same formula is applied to score levels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from clef_runtime.options import CONFIDENCE_MODES

__all__ = ["answer_confidence"]


def _normalised(probs: Sequence[float]) -> list[float]:
    total = sum(probs)
    if total <= 0:
        return [1.0 / len(probs)] * len(probs)
    return [p / total for p in probs]


def _clip(value: float) -> float:
    # The formulas lie in [0, 1] mathematically; float error must not produce -0.0 or 1.0000000002.
    return min(1.0, max(0.0, value))


def _typesafe_choice(probs: Sequence[float]) -> float:
    n = len(probs)
    uniform = 1.0 / n
    return (max(probs) - uniform) / (1.0 - uniform)


def _typesafe_score(probs: Sequence[float]) -> float:
    n = len(probs)
    mode = max(range(n), key=probs.__getitem__)
    spread = sum(p * abs(i - mode) for i, p in enumerate(probs))
    center = (n - 1) / 2
    uniform_deviation = sum(abs(i - center) for i in range(n)) / n
    return max(0.0, 1.0 - spread / uniform_deviation)


def _workers_ai(probs: Sequence[float]) -> float:
    n = len(probs)
    return (n * sum(p * p for p in probs) - 1.0) / (n - 1)


def answer_confidence(kind: Literal["choice", "score"], probs: Sequence[float], mode: str = "seed") -> float:
    """The confidence of one choice or score answer from its unrounded probabilities (a score's in level
    order), in ``mode`` (see the module docstring for each definition and its source). Not rounded.

    Returns a float in [0, 1]. Raises ValueError for an unknown mode or no probabilities.
    """
    if not probs:
        raise ValueError("no probabilities")
    if mode == "seed":
        return float(max(probs))
    if mode not in CONFIDENCE_MODES:
        raise ValueError(f"unknown confidence mode {mode!r}; expected one of {', '.join(CONFIDENCE_MODES)}")
    if len(probs) == 1:
        return 1.0
    p = _normalised([float(x) for x in probs])
    if mode == "workers-ai":
        return _clip(_workers_ai(p))
    return _clip(_typesafe_choice(p) if kind == "choice" else _typesafe_score(p))
