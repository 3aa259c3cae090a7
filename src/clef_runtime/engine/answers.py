"""Probabilities -> a System One response, exactly as the seed's ``decision.response`` and the reference's
``systemone_answer``: every number rounded to 4 decimals with Python's ``round``; choice probabilities keyed
in
the request's criteria order and the choice the first maximum in that order; score = sum(level * p).

``confidence`` (choice and score answers) follows the engine's ``--confidence`` mode, computed from the
unrounded probabilities by :func:`clef_runtime.engine.confidence.answer_confidence`: ``seed`` (the default)
is the top probability, as the seed and the reference; ``typesafe`` and ``workers-ai`` are the definitions
of those clients (documented, with their sources, in that module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from clef_runtime.encoding.encoder import EncodedRecord
from clef_runtime.engine.confidence import answer_confidence
from clef_runtime.protocol.systemone import ChoiceQuestion, NoulQuestion, SystemOneRequest

__all__ = ["DECIMALS", "build_answer", "build_response"]

DECIMALS = 4


def build_answer(
    question: Any, option_ids: Sequence[str], probs: Sequence[float], confidence: str = "seed"
) -> dict[str, Any]:
    """One answer object from a question and its probabilities in model order (``option_ids``), with the
    ``confidence`` of choice and score answers in the given mode (``seed``, ``typesafe``, ``workers-ai``).

    Returns the System One answer dict. Raises ValueError for an unknown confidence mode.
    """
    p = dict(zip(option_ids, (float(x) for x in probs), strict=True))
    if isinstance(question, NoulQuestion):
        return {"type": "noul", "noul": round(p["true"], DECIMALS)}
    if isinstance(question, ChoiceQuestion):
        order = [str(k) for k in question.criteria]
        choice = max(order, key=p.__getitem__)  # max() keeps the first maximum, as the reference
        return {
            "type": "choice",
            "choice": choice,
            "confidence": round(answer_confidence("choice", [p[k] for k in order], confidence), DECIMALS),
            "probabilities": {k: round(p[k], DECIMALS) for k in order},
        }
    levels = [str(i) for i in range(len(question.criteria))]
    return {
        "type": "score",
        "score": round(sum(i * p[k] for i, k in enumerate(levels)), DECIMALS),
        "confidence": round(answer_confidence("score", [p[k] for k in levels], confidence), DECIMALS),
        "legend": {k: question.criteria[i] for i, k in enumerate(levels)},
        "probabilities": {k: round(p[k], DECIMALS) for k in levels},
    }


def build_response(
    request: SystemOneRequest,
    record: EncodedRecord,
    probabilities: Sequence[Sequence[float]],
    served_model: str,
    confidence: str = "seed",
) -> dict[str, Any]:
    """The System One response for ``request``, with ``confidence`` computed in the given mode.

    ``probabilities[i]``: question i's option probabilities in the order of its ``option_ids``.
    ``model`` echoes the request's model, or ``served_model`` when the request named none.
    """
    answers = {
        enc.question_id: build_answer(request.questions[enc.question_id], enc.option_ids, probs, confidence)
        for enc, probs in zip(record.questions, probabilities, strict=True)
    }
    return {
        "model": request.model if request.model is not None else served_model,
        "answers": answers,
        "usage": {"input_tokens": record.input_tokens, "output_tokens": 0},
    }
