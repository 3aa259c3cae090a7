"""Answering cases: in-process through a loaded ``Clef`` (batched, unrounded probabilities) or through any
System One server URL (concurrent and bounded; the wire values are rounded to 4 decimals).

Both give `Outcome` objects in answer order (see `clef_runtime.evaluation.cases.answer_options`), so the
metrics do not care where the probabilities came from.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from clef_runtime.evaluation.cases import Case, answer_options, expected_index
from clef_runtime.evaluation.metrics import Outcome
from clef_runtime.protocol.errors import ClefError, RequestValidationError, format_loc

__all__ = [
    "Answered",
    "RemoteError",
    "RunResult",
    "answer_in_process",
    "answer_url",
    "calibrated_outcomes",
    "progress_bar",
    "systemone_url",
]

#: Wire probabilities are rounded to this many decimals (the System One response format).
WIRE_DECIMALS = 4
#: Retries of a request the server answered 429 (queue full) or 503 (not ready), with backoff.
BUSY_RETRIES = 5


class RemoteError(RuntimeError):
    """The server cannot be used at all (unreachable, wrong key, not a System One server)."""


class Progress(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


class _NoProgress:
    def update(self, n: int = 1) -> None:
        return None

    def close(self) -> None:
        return None


def progress_bar(total: int, description: str) -> Progress:
    """A tqdm bar on stderr when stderr is a terminal, else a no-op (logs and pipes stay clean)."""
    if not sys.stderr.isatty():
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="case", file=sys.stderr, leave=False)


@dataclass
class Answered:
    """One answered case: its outcomes (every question, scored or not) and its latency."""

    case: Case
    outcomes: list[Outcome]
    latency_ms: float


@dataclass
class RunResult:
    """Every case's answer or failure, and where the answers came from (``source``: ``kind`` in-process or
    url, ``model``, ``untrained``: random weights (the tiny model), ``calibration`` label or None,
    ``rounded``: whether probabilities were rounded)."""

    answered: list[Answered] = field(default_factory=list)
    failures: list[tuple[Case, str]] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def outcomes(self) -> list[Outcome]:
        """Every question's outcome, case by case in file order."""
        return [o for a in self.answered for o in a.outcomes]

    @property
    def latencies_ms(self) -> list[float]:
        """Per-case latency in milliseconds."""
        return [a.latency_ms for a in self.answered]


def _outcomes(case: Case, probs_by_question: dict[str, dict[str, float]]) -> list[Outcome]:
    """Outcomes of ``case`` from ``{question_id: {option_id: p}}`` (noul: only ``true`` is used)."""
    outcomes = []
    for question_id, question in case.request.questions.items():
        options = answer_options(question)
        given = probs_by_question[question_id]
        if question.type == "noul":
            p = float(given["true"])
            probs = np.array([p, 1.0 - p])
        else:
            probs = np.array([float(given[o]) for o in options])
        answer = case.expected.get(question_id)
        outcomes.append(
            Outcome(
                case_id=case.id,
                question_id=question_id,
                question_type=str(question.type),
                options=options,
                probs=probs,
                expected=None if answer is None else expected_index(question, answer),
            )
        )
    return outcomes


def _error_text(exc: ClefError) -> str:
    if isinstance(exc, RequestValidationError):
        return "; ".join(f"{format_loc(e['loc'])}: {e['msg']}" for e in exc.errors)
    return exc.message


def answer_in_process(
    clef: Any, cases: Sequence[Case], *, batch_size: int = 8, progress: Progress | None = None
) -> RunResult:
    """Answer ``cases`` with a loaded ``Clef``, ``batch_size`` at a time, from its unrounded probabilities
    (calibrated when the engine has a calibration). A case's latency is its batch's time (prepare + model).

    Returns a `RunResult`; a case the engine refuses (e.g. too long) is a failure, the rest continue.
    """
    calibration = getattr(clef, "calibration", None)
    result = RunResult(
        source={
            "kind": "in-process",
            "model": clef.name,
            "untrained": clef.card.model.untrained,
            "options": clef.options.as_dict(),
            "calibration": calibration.label if calibration is not None else None,
            "rounded": False,
        }
    )
    bar = progress or _NoProgress()
    for start in range(0, len(cases), batch_size):
        batch = cases[start : start + batch_size]
        started = time.perf_counter()
        prepared, kept = [], []
        for case in batch:
            try:
                prepared.append(clef.prepare(case.body))
                kept.append(case)
            except ClefError as exc:
                result.failures.append((case, _error_text(exc)))
        probs = clef.probabilities_encoded(prepared) if prepared else []
        elapsed_ms = (time.perf_counter() - started) * 1000
        for case, item, case_probs in zip(kept, prepared, probs, strict=True):
            by_question = {
                q.question_id: dict(zip(q.option_ids, p, strict=True))
                for q, p in zip(item.record.questions, case_probs, strict=True)
            }
            result.answered.append(Answered(case, _outcomes(case, by_question), elapsed_ms))
        bar.update(len(batch))
    return result


def systemone_url(url: str) -> str:
    """The ``/v1/systemone`` endpoint of a server URL (a base URL gets the path appended)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise RemoteError(f"not an http(s) URL: {url!r}")
    path = parsed.path.rstrip("/")
    if not path.endswith("/v1/systemone"):
        path += "/v1/systemone"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, parsed.query, ""))


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _http(method: str, url: str, api_key: str | None, body: Any | None, timeout: float) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; raises URLError/OSError when unreachable."""
    data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
    request = urllib.request.Request(url, data=data, method=method, headers=_headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return status, raw.decode("utf-8", "replace")[:300]


def _http_error(status: int, payload: Any) -> str:
    detail = payload.get("detail") if isinstance(payload, dict) else payload
    if isinstance(detail, list):
        detail = "; ".join(
            f"{format_loc([p for p in e.get('loc', []) if p != 'body'])}: {e.get('msg')}"
            for e in detail
            if isinstance(e, dict)
        )
    elif isinstance(detail, dict):
        detail = detail.get("message", detail)
    return f"HTTP {status}: {detail}"


def _untrained(models: dict[str, Any]) -> bool:
    """Whether a ``GET /v1/models`` body describes an untrained model: clef-runtime's own entry (the tiny
    model is not Cloudflare's) or a model card that says so."""
    entry = models["data"][0] if isinstance(models["data"][0], dict) else {}
    cards = [card for card in models.get("models") or [] if isinstance(card, dict)]
    described = any("untrained" in str(card.get("description", "")).lower() for card in cards)
    return entry.get("untrained") is True or entry.get("owned_by") == "clef-runtime" or described


def _wire_probs(case: Case, payload: Any) -> dict[str, dict[str, float]]:
    """``{question_id: {option: p}}`` from a System One response. Raises KeyError/TypeError/ValueError."""
    answers = payload["answers"]
    out: dict[str, dict[str, float]] = {}
    for question_id, question in case.request.questions.items():
        answer = answers[question_id]
        if question.type == "noul":
            out[question_id] = {"true": float(answer["noul"])}
        else:
            out[question_id] = {str(k): float(v) for k, v in answer["probabilities"].items()}
    return out


def answer_url(
    url: str,
    cases: Sequence[Case],
    *,
    api_key: str | None = None,
    concurrency: int = 4,
    timeout: float = 300.0,
    progress: Progress | None = None,
) -> RunResult:
    """Answer ``cases`` through a System One server, at most ``concurrency`` requests in flight. Latency is
    each request's round trip. Probabilities are the wire's (rounded to 4 decimals).

    Returns a `RunResult` (a refused case is a failure with the server's message). Raises `RemoteError`
    when the server cannot be reached or refuses the key (checked once with ``GET /v1/models`` first).
    """
    endpoint = systemone_url(url)
    models_url = endpoint[: -len("/systemone")] + "/models"
    try:
        status, info = _http("GET", models_url, api_key, None, timeout)
    except (urllib.error.URLError, OSError) as exc:
        raise RemoteError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    if status == 401:
        raise RemoteError(f"{url} refused the API key (HTTP 401): pass the server's key with --api-key")
    model, calibration, untrained = None, None, False
    if status == 200 and isinstance(info, dict) and info.get("data"):
        entry = info["data"][0]
        model = entry.get("id")
        calibration = (entry.get("x_calibration") or {}).get("label")
        untrained = _untrained(info)
    result = RunResult(
        source={
            "kind": "url",
            "url": endpoint,
            "model": model,
            "untrained": untrained,
            "calibration": calibration,
            "rounded": True,
        }
    )
    bar = progress or _NoProgress()

    def one(case: Case) -> tuple[Case, dict[str, dict[str, float]] | str, float]:
        for attempt in range(BUSY_RETRIES + 1):
            started = time.perf_counter()
            try:
                status, payload = _http("POST", endpoint, api_key, case.body, timeout)
            except (urllib.error.URLError, OSError) as exc:
                return case, f"request failed: {getattr(exc, 'reason', exc)}", 0.0
            elapsed_ms = (time.perf_counter() - started) * 1000
            # A full queue (429) or a server still loading (503) is not the case's fault: wait and retry.
            if status not in (429, 503) or attempt == BUSY_RETRIES:
                break
            time.sleep(min(2.0**attempt, 10.0))
        if status != 200:
            return case, _http_error(status, payload), elapsed_ms
        try:
            return case, _wire_probs(case, payload), elapsed_ms
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return case, f"not a System One response ({type(exc).__name__}: {exc})", elapsed_ms

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for case, got, elapsed_ms in pool.map(one, cases):
            if isinstance(got, str):
                result.failures.append((case, got))
            else:
                result.answered.append(Answered(case, _outcomes(case, got), elapsed_ms))
            bar.update(1)
    return result


def calibrated_outcomes(
    outcomes: Sequence[Outcome], apply: Callable[[str, str, Sequence[float]], Sequence[float]]
) -> list[Outcome]:
    """``outcomes`` with ``apply(question_id, question_type, probs)`` (a `Calibration.apply`) applied."""
    return [
        Outcome(
            case_id=o.case_id,
            question_id=o.question_id,
            question_type=o.question_type,
            options=o.options,
            probs=np.asarray(apply(o.question_id, o.question_type, o.probs.tolist()), dtype=float),
            expected=o.expected,
        )
        for o in outcomes
    ]
