"""What the engine returns for one request: a typed `Decision` (answers, cache report, calibration, timings),
and the one place its System One wire body is composed (`Decision.body`).

The engine never writes wire extras into a dict that someone else edits later: the server takes the
record, asks for the body once (deterministic or not) and adds only what belongs to HTTP (latency,
headers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clef_runtime.engine.head_records import HeadIdentity

__all__ = ["CacheReport", "Decision", "RequestTimings"]


@dataclass(frozen=True)
class CacheReport:
    """What the state cache did for a request: ``status`` ``"hit"`` (the whole state reused: from the cache
    or from a request that computed it just before), ``"partial"`` (a cached prefix of it) or ``"miss"``;
    ``cached_tokens``: image and state tokens reused (``usage.input_tokens_details.cached_tokens``; the
    always-cached prompt prefix is not counted)."""

    status: str
    cached_tokens: int


MISS = CacheReport("miss", 0)


@dataclass(frozen=True)
class RequestTimings:
    """Where one request's time went, and the work it cost.

    ``queue_s``: from submission to the start of its first step; ``compute_s``: from there to its answer
    (its own steps and those of the work it shared them with); ``steps``: engine steps it took part in;
    ``backbone_tokens``: tokens it ran through the backbone (0 for an engine without a backbone count).

    The moments (``submitted_at``, ``step_times``) are on the engine loop's clock (`time.monotonic` unless
    the loop was given another): the server places its trace spans with them (`clef_runtime.server.tracing`)
    without the engine knowing anything of tracing.
    """

    queue_s: float = 0.0
    compute_s: float = 0.0
    steps: int = 0
    backbone_tokens: int = 0
    submitted_at: float | None = None
    """When it was submitted to the loop; None where the engine does not say."""
    step_times: tuple[tuple[float, float], ...] = ()
    """Start and end of its work in each step it took part in, in order."""
    head_s: float = 0.0
    """Seconds the head took to score it (with the rows completed beside it), at the end of its last step."""


@dataclass(frozen=True)
class Decision:
    """One answered request."""

    model: str
    """The model named in the response (the request's ``model``, else the served model's name)."""
    answers: dict[str, Any]
    """The System One answers, by question id."""
    input_tokens: int
    cache: CacheReport = MISS
    calibration: str | None = None
    """The label of the calibration applied to the probabilities (None: none)."""
    timings: RequestTimings = field(default_factory=RequestTimings)
    replica: str | None = None
    """The model replica that answered (scale-out), None for an engine in this process."""
    probabilities: list[list[float]] | None = field(default=None, repr=False, compare=False)
    """Unrounded probabilities per question, per option in model order (calibrated when the engine has a
    calibration): what ``answers`` rounds. None where the engine does not report them."""
    head: HeadIdentity | None = None
    """The head that computed the answers (``X-Clef-Head``, ``x_head``); None where the engine has none."""
    explanation: dict[str, Any] | None = None
    """With ``x_explain``: how the answers' ``x_evidence`` was computed (``method``, ``granularity``,
    ``top_k``, what a ``weight`` means and, for a JSON state, the rendered ``state_text`` the spans' offsets
    point into): the body's ``x_explain``. None without it."""

    def body(self, *, deterministic: bool = False) -> dict[str, Any]:
        """The System One response body. ``deterministic``: identical requests must give identical bytes,
        so the cache report (a repeated request is served from the cache) stays out of the body
        (``cached_tokens`` 0, no ``x_state_cache``); the server still sends it in headers."""
        body: dict[str, Any] = {
            "model": self.model,
            "answers": self.answers,
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": 0,
                "input_tokens_details": {"cached_tokens": 0 if deterministic else self.cache.cached_tokens},
            },
        }
        if not deterministic:
            body["x_state_cache"] = self.cache.status
        if self.calibration is not None:
            body["x_calibration"] = self.calibration
        if self.head is not None:
            body["x_head"] = self.head.as_api()
        if self.explanation is not None:
            body["x_explain"] = self.explanation
        return body
