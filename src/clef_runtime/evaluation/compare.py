"""``clef compare``: the same cases through two models, modes or servers, and how far their probabilities
drift: max and mean |dp| over every option probability, top-1 agreement, and the flips with their margins.

A side is a SPEC: ``model=tiny,weights=fp32,prefill_chunk=64`` (``model`` plus engine option names, dashes
or underscores, each value parsed and validated as its flag), or a server: ``url=http://host:port`` (or a
bare http(s) URL) with an optional ``api_key=K``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clef_runtime.evaluation.metrics import Outcome
from clef_runtime.evaluation.runner import RunResult
from clef_runtime.options import ENGINE_OPTIONS, EngineOptions, OptionsError

__all__ = ["Side", "compare_results", "parse_side"]

_OPTION_BY_FIELD = {option.field: option for option in ENGINE_OPTIONS}
_SIDE_KEYS = ("model", "url", "api_key")


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a model with its engine options, or a server URL."""

    spec: str
    model: str | None = None
    options: EngineOptions | None = None
    url: str | None = None
    api_key: str | None = None

    def describe(self) -> dict[str, Any]:
        """The side for reports: its spec and what it resolves to (the API key is never shown)."""
        if self.url is not None:
            return {"spec": self.spec.replace(self.api_key or "\0", "***"), "url": self.url}
        assert self.options is not None
        return {"spec": self.spec, "model": self.model, "options": self.options.as_dict()}


def parse_side(text: str, flag: str = "--a") -> Side:
    """Parse a SPEC (see the module docstring). Raises `OptionsError` naming ``flag`` and the bad key."""
    text = text.strip()
    if text.startswith(("http://", "https://")):
        return Side(spec=text, url=text)
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise OptionsError(f"{flag} {text!r}: {item!r} is not KEY=VALUE")
        if key not in _SIDE_KEYS and key not in _OPTION_BY_FIELD:
            known = ", ".join((*_SIDE_KEYS, *_OPTION_BY_FIELD))
            raise OptionsError(f"{flag}: unknown key {key!r} (use one of: {known})")
        if key in values:
            raise OptionsError(f"{flag}: {key} is given twice")
        values[key] = value.strip()
    if "url" in values:
        extra = set(values) - {"url", "api_key"}
        if extra:
            raise OptionsError(f"{flag}: url= cannot be combined with {', '.join(sorted(extra))}")
        return Side(spec=text, url=values["url"], api_key=values.get("api_key"))
    if "model" not in values:
        raise OptionsError(f"{flag} {text!r}: needs model=... or url=...")
    if "api_key" in values:
        raise OptionsError(f"{flag}: api_key= goes with url=, not with model=")
    parsed: dict[str, Any] = {}
    for key, raw in values.items():
        if key == "model":
            continue
        option = _OPTION_BY_FIELD[key]
        try:
            value = option.parse(raw)
            if option.choices is not None and value not in option.choices:
                raise ValueError(f"must be one of {', '.join(option.choices)}")
        except ValueError as exc:
            raise OptionsError(f"{flag}: {key}={raw!r} ({option.flag}): {exc}") from None
        parsed[key] = value
    try:
        options = EngineOptions(**parsed)
    except OptionsError as exc:
        raise OptionsError(f"{flag}: {exc}") from None
    return Side(spec=text, model=values["model"], options=options)


def _key(outcome: Outcome) -> tuple[str, str]:
    return outcome.case_id, outcome.question_id


def _summary(pairs: Sequence[tuple[Outcome, Outcome]]) -> dict[str, Any]:
    diffs = np.concatenate([np.abs(a.probs - b.probs) for a, b in pairs])
    agree = [a.predicted == b.predicted for a, b in pairs]
    return {
        "questions": len(pairs),
        "max_abs_dp": float(diffs.max()),
        "mean_abs_dp": float(diffs.mean()),
        "top1_agreement": float(np.mean(agree)),
    }


def compare_results(a: RunResult, b: RunResult) -> dict[str, Any]:
    """The drift between two runs over the questions both answered: ``questions``, ``max_abs_dp``,
    ``mean_abs_dp`` (over every option probability; noul counts p and 1-p), ``top1_agreement``, ``by_type``
    (the same per question type), ``flips`` (questions whose top-1 differs, with both sides' option,
    probability and margin = top-1 minus top-2) and ``missing`` (case ids answered by one side only).

    Raises ValueError when the two runs have no question in common or disagree on a question's options.
    """
    b_by_key = {_key(o): o for o in b.outcomes}
    pairs = []
    for outcome in a.outcomes:
        other = b_by_key.get(_key(outcome))
        if other is None:
            continue
        if other.options != outcome.options:
            raise ValueError(f"case {outcome.case_id} question {outcome.question_id}: options differ")
        pairs.append((outcome, other))
    if not pairs:
        raise ValueError("the two sides have no answered question in common")
    by_type: dict[str, list[tuple[Outcome, Outcome]]] = {}
    for pair in pairs:
        by_type.setdefault(pair[0].question_type, []).append(pair)
    flips = [
        {
            "case": x.case_id,
            "question": x.question_id,
            "type": x.question_type,
            "a": x.options[x.predicted],
            "b": y.options[y.predicted],
            "a_p": float(x.probs[x.predicted]),
            "b_p": float(y.probs[y.predicted]),
            "a_margin": x.margin,
            "b_margin": y.margin,
        }
        for x, y in pairs
        if x.predicted != y.predicted
    ]
    a_cases = {item.case.id for item in a.answered}
    b_cases = {item.case.id for item in b.answered}
    return {
        **_summary(pairs),
        "by_type": {kind: _summary(group) for kind, group in by_type.items()},
        "flips": flips,
        "missing": {"a_only": sorted(a_cases - b_cases), "b_only": sorted(b_cases - a_cases)},
        "rounded": bool(a.source.get("rounded") or b.source.get("rounded")),
    }
