"""Independent questions (``"x_independent": true``): each question answered as if it were asked alone.

By default the head decodes a request's questions jointly (they attend to each other), so an answer may
depend on which other questions share the request. An independent request runs as one request per question
(`clef_runtime.protocol.systemone.independent_parts`): the parts share the state, so the state cache (or the
loop's hand-off of a state being computed) runs the state's prefill once and each part adds only its own
schema. Their decisions are merged back into one (`merge_decisions`), answers in the request's order.

`submit_parts` is the one place that turns the parts' futures into the request's: the server's interactive
and background lanes and `Clef.decide_encoded` all go through it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from clef_runtime.engine.decision import CacheReport, Decision, RequestTimings
from clef_runtime.protocol.systemone import SystemOneRequest

if TYPE_CHECKING:
    from clef_runtime.encoding.encoder import EncodedRecord

__all__ = ["IndependentRequest", "PartsRow", "RecordTokens", "merge_decisions", "submit_parts"]

PartT = TypeVar("PartT")


@dataclass(frozen=True)
class PartsRow:
    """The token accounting of an independent request: what its parts read in all (each part is a request
    of its own: ``usage.input_tokens`` is their sum, the shared state counted per part and reported as
    cached where it was reused), and the most state tokens any part had to cut."""

    input_tokens: int
    truncated_state_tokens: int


class _HasRecord(Protocol):
    @property
    def record(self) -> EncodedRecord | PartsRow: ...


class RecordTokens:
    """``input_tokens`` / ``truncated_state_tokens`` of a prepared request, read from its ``record`` (so it
    can stand where an ``EncodedRecord`` is expected for accounting)."""

    @property
    def input_tokens(self: _HasRecord) -> int:
        """The number of tokens the model reads (``usage.input_tokens``)."""
        return self.record.input_tokens

    @property
    def truncated_state_tokens(self: _HasRecord) -> int:
        """State tokens cut to fit the token limit."""
        return self.record.truncated_state_tokens


@dataclass(frozen=True, eq=False)
class IndependentRequest(RecordTokens, Generic[PartT]):
    """A prepared ``x_independent`` request: the request as sent and one prepared request per question."""

    request: SystemOneRequest
    parts: tuple[PartT, ...]

    @property
    def record(self) -> PartsRow:
        """The parts' token accounting (see `PartsRow`)."""
        rows = [part.record for part in self.parts]  # type: ignore[attr-defined]
        return PartsRow(
            input_tokens=sum(row.input_tokens for row in rows),
            truncated_state_tokens=max(row.truncated_state_tokens for row in rows),
        )


def _cache_status(statuses: Sequence[str]) -> str:
    if all(status == "hit" for status in statuses):
        return "hit"
    if all(status == "miss" for status in statuses):
        return "miss"
    return "partial"


def merge_decisions(request: SystemOneRequest, decisions: Sequence[Decision]) -> Decision:
    """One decision for an independent request from its parts' (one per question, in the request's order):
    the answers and probabilities in order, tokens and cached tokens summed, the cache status ``hit`` when
    every part hit, ``miss`` when every part missed, else ``partial``; the timings span the parts."""
    if not decisions:
        raise ValueError("an independent request has at least one part")
    answers: dict[str, Any] = {}
    for decision in decisions:
        answers.update(decision.answers)
    ordered = {question_id: answers[question_id] for question_id in request.questions}
    probabilities = None
    if all(decision.probabilities is not None for decision in decisions):
        probabilities = [p for decision in decisions for p in decision.probabilities or []]
    first = min(decision.timings.queue_s for decision in decisions)
    last = max(decision.timings.queue_s + decision.timings.compute_s for decision in decisions)
    return Decision(
        model=decisions[0].model,
        answers=ordered,
        input_tokens=sum(decision.input_tokens for decision in decisions),
        cache=CacheReport(
            _cache_status([decision.cache.status for decision in decisions]),
            sum(decision.cache.cached_tokens for decision in decisions),
        ),
        calibration=decisions[0].calibration,
        head=decisions[0].head,
        timings=RequestTimings(
            queue_s=first,
            compute_s=last - first,
            steps=max(decision.timings.steps for decision in decisions),
            backbone_tokens=sum(decision.timings.backbone_tokens for decision in decisions),
            submitted_at=min(
                (t for d in decisions if (t := d.timings.submitted_at) is not None), default=None
            ),
            step_times=tuple(sorted({span for d in decisions for span in d.timings.step_times})),
            head_s=max(decision.timings.head_s for decision in decisions),
        ),
        replica=decisions[0].replica,
        probabilities=probabilities,
        # Every part explains the same state with the same options: one record serves them all.
        explanation=decisions[0].explanation,
    )


def submit_parts(
    item: IndependentRequest[PartT], submit: Callable[[PartT], Future[Decision]]
) -> Future[Decision]:
    """Submit every part of ``item`` with ``submit`` (a loop's or dispatcher's) and return the future of the
    merged decision. It fails with the first part that fails (the other parts are cancelled); cancelling it
    cancels every part, waiting or running. If a submission raises (a full queue), the parts already
    submitted are cancelled and the error is raised."""
    futures: list[Future[Decision]] = []
    try:
        for part in item.parts:
            futures.append(submit(part))
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    merged: Future[Decision] = Future()
    lock = threading.Lock()
    left = [len(futures)]

    def part_done(future: Future[Decision]) -> None:
        failure: BaseException | None = None
        if future.cancelled():
            if not merged.cancelled():
                failure = RuntimeError("a part of an independent request was cancelled")
        else:
            failure = future.exception()
        with lock:
            left[0] -= 1
            finished = left[0] == 0
            if merged.done():
                return
            # The merged future may be cancelled by another thread at any moment: setting it then is a no-op.
            with contextlib.suppress(InvalidStateError):
                if failure is not None:
                    merged.set_exception(failure)
                elif finished:
                    try:
                        result = merge_decisions(item.request, [f.result() for f in futures])
                    except Exception as exc:  # a part's answer that cannot merge: fail, never hang
                        merged.set_exception(exc)
                    else:
                        merged.set_result(result)
        if failure is not None:
            for other in futures:
                other.cancel()

    def merged_done(future: Future[Decision]) -> None:
        if future.cancelled():
            for part in futures:
                part.cancel()

    merged.add_done_callback(merged_done)
    for future in futures:
        future.add_done_callback(part_done)
    return merged
