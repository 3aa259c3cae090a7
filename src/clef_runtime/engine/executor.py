"""The engine's executor: the state-cache driver and the step runner over one loaded model.

The engine loop (`clef_runtime.engine.loop`) decides what each step does (`clef_runtime.engine.policy`);
this module does it:

1. **estimate** a request when it arrives: where the state cache lets it resume (the longest cached prefix
   of its state, a prefix tree over the state's ids: `clef_runtime.engine.state_cache`), so the policy knows
   how much work it is and which requests can share a batch;
2. **admit** requests: look them up again (the cache may have grown meanwhile), group them by the cached
   point they resume at, plan each row's snapshots (`clef_runtime.engine.planning`), embed the images of
   rows that start before their image block (the vision tower is loaded on first use) and open one
   `clef_runtime.model.prefill.BatchPrefill` per group over a copy of the start state;
3. **advance** a batch by a chunk: the rows that complete get their hidden rows (start state's rows + their
   own), the lexical rows, the joint schema head in fp32, per-question softmax and calibration, and come
   back as `Decision` records at once; what they computed is stored in the prefix tree.

Nothing of one request is kept on the model for the next: positions are explicit, caches are fresh copies,
and cached states are never modified. Every call that touches the model holds the engine's model lock, so
several loops (the server's, a direct `Clef.decide_encoded`) interleave step by step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Collection, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from clef_runtime.engine.answers import build_answer
from clef_runtime.engine.decision import MISS, CacheReport, Decision, RequestTimings
from clef_runtime.engine.explain import explain_row
from clef_runtime.engine.heads import HeadSet, ServedHead
from clef_runtime.engine.images import ImageEmbedder, PreparedImage, row_positions
from clef_runtime.engine.loop import Estimate
from clef_runtime.engine.planning import MAX_SNAPSHOT_ROWS, PlanRow, RowPlan, plan_rows
from clef_runtime.engine.preparer import PreparedRequest
from clef_runtime.engine.state_cache import TEXT_ROOT, Match, StateCache
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.head import HeadLayout, probabilities
from clef_runtime.model.kernels import flush_denormals
from clef_runtime.model.lexical import LexicalTable
from clef_runtime.model.prefill import BatchPrefill
from clef_runtime.model.state import BackboneState, Continuation, StatePoint, StateSegment
from clef_runtime.options import EngineOptions

__all__ = ["ExecutorWork", "StepExecutor", "head_inputs"]

logger = logging.getLogger("clef_runtime.engine")

PREFIX_START = "prompt-prefix"
"""The start identity of rows that resume at the prompt prefix."""

_HANDOFF_LIMIT = 2
"""State ends kept for waiting requests when the state cache is off (each one is a whole state)."""


@dataclass
class ExecutorWork:
    """Cumulative work of an executor (a synchronous call reports the difference over its own run)."""

    backbone_s: float = 0.0
    head_s: float = 0.0
    vision_s: float = 0.0
    backbone_tokens: int = 0
    requests: int = 0


def head_inputs(record: Any, lexical: LexicalTable) -> tuple[HeadLayout, Tensor]:
    """What the head reads of an encoded record besides its hidden rows: where its questions and options
    are (`HeadLayout`) and each option's mean ``lm_head`` row [O, hidden] (see `LexicalTable`)."""
    layout = HeadLayout(
        type_ids=[q.type_id for q in record.questions],
        question_spans=[q.question_span for q in record.questions],
        option_spans=[list(q.option_spans) for q in record.questions],
    )
    spans = [span for question in record.questions for span in question.option_spans]
    return layout, lexical.option_means(record.input_ids, spans)


@dataclass(eq=False)
class _Row:
    """One admitted request: ``index`` into the admitted items, where it resumes and what it stores."""

    index: int
    work: PreparedRequest
    start_at: int
    plan: RowPlan
    share: bool


@dataclass(eq=False)
class _AdmittedBatch:
    """Admitted rows that continue one start state, advanced together by their executor
    (`StepExecutor.advance`)."""

    start: BackboneState
    rows: dict[int, _Row]
    prefill: BatchPrefill | None = None
    """None for the seed's readout, which computes each row whole in its first advance."""
    numbers: dict[int, int] = field(default_factory=dict)
    """Row index -> row number in the prefill."""

    def remaining(self) -> dict[int, int]:
        """Tokens every row still in the batch has to compute, by admitted index."""
        if self.prefill is None:
            return {index: row.work.record.input_tokens for index, row in self.rows.items()}
        return {index: self.prefill.remaining(self.numbers[index]) for index in self.rows}

    def drop(self, indexes: Iterable[int]) -> None:
        """Take rows out (a cancelled request): nothing of theirs is stored."""
        gone = [index for index in indexes if index in self.rows]
        for index in gone:
            del self.rows[index]
        if self.prefill is not None:
            self.prefill.drop(self.numbers[index] for index in gone)


class StepExecutor:
    """Runs steps over one loaded model (see the module docstring). Thread-safe: every model call holds
    ``model_lock``."""

    def __init__(
        self,
        *,
        name: str,
        backbone: Backbone,
        heads: HeadSet,
        lexical: LexicalTable,
        embedder: ImageEmbedder,
        state_cache: StateCache,
        prefix_ids: Sequence[int],
        model_lock: threading.Lock,
        options: EngineOptions,
        max_snapshot_rows: int = MAX_SNAPSHOT_ROWS,
        tokenizer: Any = None,
    ) -> None:
        self.name = name
        self.backbone = backbone
        self.heads = heads
        self.lexical = lexical
        self.embedder = embedder
        self.state_cache = state_cache
        self.prefix_ids = list(prefix_ids)
        self.model_lock = model_lock
        self.options = options
        """Read for ``prefill_chunk``, ``pad_last_chunk``, ``snapshot_interval`` and ``confidence``."""
        self.max_snapshot_rows = max_snapshot_rows
        self.tokenizer = tokenizer
        """The encoder's tokenizer: ``x_explain`` maps state tokens to characters with it."""
        self.work = ExecutorWork()
        self._work_lock = threading.Lock()
        self._handoff: dict[bytes, BackboneState] = {}
        self._collect: dict[int, Tensor] | None = None
        with model_lock, torch.inference_mode():
            # The constant prompt prefix is the starting point of every cold row: computed once, kept for
            # good (outside the LRU budget; a few KB per token).
            self.prefix_state: BackboneState = backbone.initial_state(self.prefix_ids)

    # ------------------------------------------------------------------------------------------ lookup

    def _check_prefix(self, record: Any) -> None:
        if list(record.input_ids[: self.prefix_state.length]) != self.prefix_ids:
            raise ValueError("the record does not start with this model's prompt prefix")

    def _match(self, w: PreparedRequest) -> Match:
        record = w.record
        if not self.state_cache.enabled:
            return Match(root=w.root_key == TEXT_ROOT, length=0)
        return self.state_cache.lookup(w.root_key, record.input_ids[record.state_start : record.state_end])

    def _resume_at(self, w: PreparedRequest, match: Match) -> int:
        return w.record.state_start + match.length if match.root else self.prefix_state.length

    def estimate(self, item: PreparedRequest) -> Estimate:
        """Where ``item`` would resume now (see `Estimate`). Raises ValueError for a record that does not
        start with the prompt prefix."""
        self._check_prefix(item.record)
        if self.options.pad_last_chunk:
            return Estimate(item.record.input_tokens, None, None)
        record = item.record
        if item.state_key in self._handoff:
            return Estimate(record.input_tokens - record.state_end, ("handoff", item.state_key), None)
        match = self._match(item)
        resume_at = self._resume_at(item, match)
        group = match.start if resume_at > self.prefix_state.length else PREFIX_START
        # A state cached whole has nothing left to share: requests about it never wait for each other.
        hold = item.state_key if resume_at < record.state_end else None
        return Estimate(record.input_tokens - resume_at, group, hold)

    # --------------------------------------------------------------------------------------- admission

    def admit(
        self,
        items: Sequence[PreparedRequest],
        *,
        share: Collection[Hashable] = (),
        held: Collection[int] = (),
    ) -> list[_AdmittedBatch]:
        """Start ``items`` as batches (one per cached point they resume at). ``share``: states other
        waiting requests want (their rows snapshot the state end even with the cache off); ``held``:
        indexes of items that waited for another request's state. Returns the batches; their rows are keyed
        by index into ``items``. Raises ValueError for an item that cannot run (the loop retries the items
        one by one to find it)."""
        wanted = {*share, *(w.state_key for w in items)}
        for key in [key for key in self._handoff if key not in wanted]:
            del self._handoff[key]
        if self.options.pad_last_chunk:
            return [
                _AdmittedBatch(self.prefix_state, {i: _Row(i, w, 0, RowPlan((), False, MISS), False)})
                for i, w in enumerate(items)
            ]
        groups: dict[Any, list[tuple[int, PreparedRequest, int]]] = {}
        starts: dict[Any, BackboneState] = {}
        cache = self.state_cache
        prefix = self.prefix_state
        for index, w in enumerate(items):
            self._check_prefix(w.record)
            handed = self._handoff.get(w.state_key)
            if handed is not None:
                start_key: Any = ("handoff", w.state_key)
                starts[start_key] = handed
                resume_at = w.record.state_end
            else:
                match = self._match(w)
                resume_at = self._resume_at(w, match)
                start_key = PREFIX_START
                if resume_at > prefix.length:
                    start_key = match.start
                    if start_key not in starts:
                        assert isinstance(match.point, StatePoint)
                        starts[start_key] = prefix.assemble(match.segments, match.point)  # type: ignore[arg-type]
            groups.setdefault(start_key, []).append((index, w, resume_at))
        starts.setdefault(PREFIX_START, prefix)
        batches = []
        for start_key, members in groups.items():
            plans = plan_rows(
                [
                    PlanRow(
                        state_start=w.record.state_start,
                        state_end=w.record.state_end,
                        resume_at=resume_at,
                        tail_at=w.tail_at,
                        images=bool(w.record.image_blocks),
                        share=w.state_key in share,
                    )
                    for _, w, resume_at in members
                ],
                prefix_length=prefix.length,
                store=cache.enabled,
                snapshot_interval=self.options.snapshot_interval,
                max_snapshot_rows=self.max_snapshot_rows,
            )
            rows = {
                index: _Row(index, w, resume_at, plan, w.state_key in share)
                for (index, w, resume_at), plan in zip(members, plans, strict=True)
            }
            for row in rows.values():
                self._count_admission(row, index_held=row.index in held)
            batches.append(self._open(starts[start_key], rows))
        return batches

    def _count_admission(self, row: _Row, *, index_held: bool) -> None:
        cache = self.state_cache
        report = row.plan.report
        if cache.enabled:
            cache.record(report.status)
        if index_held and report.status == "hit":
            cache.add_shared()
        if row.start_at or report.cached_tokens:
            cache.add_saved(row.start_at, report.cached_tokens)

    def _open(self, start: BackboneState, rows: dict[int, _Row]) -> _AdmittedBatch:
        """A batch of ``rows`` over a copy of ``start`` (images embedded for rows that need them)."""
        ordered = list(rows.values())
        started = time.perf_counter()
        with self.model_lock, flush_denormals(), torch.inference_mode():
            images = [w.work.images if w.start_at < w.work.record.state_start else () for w in ordered]
            tower_rows = self._image_rows(images)
            continuations = [
                self._continuation(row, start, own) for row, own in zip(ordered, tower_rows, strict=True)
            ]
            prefill = BatchPrefill(
                self.backbone,
                start,
                continuations,
                prefill_chunk=self.options.prefill_chunk,
                max_call_tokens=self.backbone.max_call_tokens,
            )
        self._add_work(backbone_s=time.perf_counter() - started)
        return _AdmittedBatch(start, rows, prefill, {row.index: n for n, row in enumerate(ordered)})

    def _image_rows(self, image_lists: Sequence[Sequence[PreparedImage]]) -> list[list[Tensor]]:
        """Tower rows of every image of every list (one tower pass for them all), per list."""
        images = [image for images in image_lists for image in images]
        if not images:
            return [[] for _ in image_lists]
        started = time.perf_counter()
        rows = self.embedder.embed(images)
        self._add_work(vision_s=time.perf_counter() - started)
        out, index = [], 0
        for own in image_lists:
            out.append(rows[index : index + len(own)])
            index += len(own)
        return out

    def _continuation(self, row: _Row, start: BackboneState, images: Sequence[Tensor]) -> Continuation:
        """Row ``row`` from its start position (where ``start`` ends) to its end."""
        record, at = row.work.record, row.start_at
        if start.length != at:
            raise RuntimeError(f"a start state of {start.length} tokens cannot resume a row at {at}")
        positions = row_positions(record, row.work.images)
        if positions is not None:
            if not bool((positions[:, at] == start.next_position).all()):
                raise RuntimeError("a cached state's next position does not match the request's row")
            positions = positions[:, at:]
        return Continuation(
            input_ids=record.input_ids[at:],
            positions=positions,
            image_rows=[
                (first_pad - at, image)
                for (first_pad, _), image in zip(record.image_blocks, images, strict=True)
            ]
            if images
            else [],
            points=tuple(p - at for p in row.plan.points),
        )

    # ----------------------------------------------------------------------------------------- advance

    def advance(self, batch: _AdmittedBatch, tokens: int) -> dict[int, Decision]:
        """Compute the next ``tokens`` tokens of ``batch``; returns the decisions of the rows that completed
        (they leave the batch)."""
        t0 = time.perf_counter()
        with self.model_lock, flush_denormals(), torch.inference_mode():
            if batch.prefill is None:
                hiddens = self._seed_rows(batch)
            else:
                hiddens = {}
                for number in batch.prefill.advance(tokens):
                    index = next(i for i, n in batch.numbers.items() if n == number)
                    hiddens[index] = self._completed(batch, index, number)
            t1 = time.perf_counter()
            collect = self._collect
            if collect is not None:
                for index, hidden in hiddens.items():
                    collect[id(batch.rows[index].work)] = hidden
            decisions = self._decide(batch, hiddens)
        head_s = time.perf_counter() - t1
        self._add_work(backbone_s=t1 - t0, head_s=head_s)
        for index in hiddens:
            del batch.rows[index]
        return {
            index: replace(decision, timings=replace(decision.timings, head_s=head_s))
            for index, decision in decisions.items()
        }

    def _completed(self, batch: _AdmittedBatch, index: int, number: int) -> Tensor:
        """Store what row ``index`` computed (its snapshots), and return its whole hidden rows."""
        assert batch.prefill is not None
        row = batch.rows[index]
        result = batch.prefill.result(number)
        self._add_work(tokens=row.work.record.input_tokens - row.start_at)
        if row.plan.points:
            assert result.segment is not None
            points = dict(zip(row.plan.points, result.points, strict=True))
            if row.plan.store:
                self._store(row, result.segment, points)
            if row.share and not self.state_cache.enabled:
                end = row.work.record.state_end
                while len(self._handoff) >= _HANDOFF_LIMIT:
                    del self._handoff[next(iter(self._handoff))]
                self._handoff[row.work.state_key] = batch.start.assemble([result.segment], points[end])
        return torch.cat([batch.start.hidden, result.hidden])

    def _seed_rows(self, batch: _AdmittedBatch) -> dict[int, Tensor]:
        """The seed's readout: each row alone from zero states in ``prefill_chunk``-token calls, the last
        call padded with ``<|endoftext|>``; no state cache."""
        rows = list(batch.rows.values())
        image_rows = self._image_rows([row.work.images for row in rows])
        hiddens = {}
        for row, images in zip(rows, image_rows, strict=True):
            record = row.work.record
            embeds = self.backbone.embeddings(
                record.input_ids,
                image_rows=[
                    (first_pad, image)
                    for (first_pad, _), image in zip(record.image_blocks, images, strict=True)
                ],
            )
            hiddens[row.index] = self.backbone.hidden_states(
                record.input_ids,
                prefill_chunk=self.options.prefill_chunk,
                pad_last_chunk=True,
                position_ids=row_positions(record, row.work.images),
                inputs_embeds=embeds,
            )
            self._add_work(tokens=record.input_tokens)
        return hiddens

    def _decide(self, batch: _AdmittedBatch, hiddens: dict[int, Tensor]) -> dict[int, Decision]:
        """Head, softmax, calibration and answers for the rows in ``hiddens``."""
        if not hiddens:
            return {}
        indexes = list(hiddens)
        rows = [batch.rows[index] for index in indexes]
        records = [row.work.record for row in rows]
        inputs = [head_inputs(record, self.lexical) for record in records]
        # Rows of several heads may complete in one step: each head scores its own rows in one pass.
        served = [row.work.head or self.heads.for_model(row.work.request.model) for row in rows]
        by_head: dict[int, list[int]] = {}
        for position, head in enumerate(served):
            by_head.setdefault(id(head), []).append(position)
        logits: list[Any] = [None] * len(rows)
        for positions in by_head.values():
            scored = served[positions[0]].head.score_batch(
                [hiddens[indexes[p]] for p in positions],
                [inputs[p][0] for p in positions],
                [inputs[p][1] for p in positions],
            )
            for position, row_logits in zip(positions, scored, strict=True):
                logits[position] = row_logits
        decisions = {}
        for index, row, lg, (layout, lexical), head in zip(
            indexes, rows, logits, inputs, served, strict=True
        ):
            probs = [p.tolist() for p in probabilities(lg, layout)]
            decision = self.decision(
                row.work, probs, row.plan.report, row.work.record.input_tokens - row.start_at, head=head
            )
            if row.work.request.x_explain is not None:
                decision = self._explained(decision, row.work, head, hiddens[index], layout, lexical, probs)
            decisions[index] = decision
        with self._work_lock:
            self.work.requests += len(indexes)
        return decisions

    def _explained(
        self,
        decision: Decision,
        w: PreparedRequest,
        head: ServedHead,
        hidden: Tensor,
        layout: HeadLayout,
        lexical: Tensor,
        probs: list[list[float]],
    ) -> Decision:
        """``decision`` with each answer's ``x_evidence`` and the explanation record (``x_explain``)."""
        if self.tokenizer is None:
            raise RuntimeError("this executor was built without the tokenizer x_explain needs")
        explanation = explain_row(
            head.head,
            hidden,
            layout,
            lexical,
            w.request,
            w.record,
            w.images,
            probs,
            self.tokenizer,
            self.options.explain_method,
        )
        answers = {
            question_id: {**answer, "x_evidence": explanation.evidence[question_id]}
            for question_id, answer in decision.answers.items()
        }
        return replace(decision, answers=answers, explanation=explanation.record)

    def calibrated(
        self, w: PreparedRequest, probs: list[list[float]], head: ServedHead | None = None
    ) -> list[list[float]]:
        """``probs`` with the temperatures of the calibration of ``w``'s head applied per question (unchanged
        without one); ``head``: the head that answered (default: the one ``w``'s ``model`` picks)."""
        calibration = (head or w.head or self.heads.for_model(w.request.model)).calibration
        if calibration is None:
            return probs
        return [
            calibration.apply(q.question_id, q.question_type, p)
            for q, p in zip(w.record.questions, probs, strict=True)
        ]

    def decision(
        self,
        w: PreparedRequest,
        probs: list[list[float]],
        report: CacheReport,
        tokens: int,
        *,
        head: ServedHead | None = None,
    ) -> Decision:
        """The `Decision` for ``w`` from its unrounded, uncalibrated probabilities (``head``: the head that
        answered; default: the one ``w``'s ``model`` picks)."""
        head = head or w.head or self.heads.for_model(w.request.model)
        calibration = head.calibration
        probs = self.calibrated(w, probs, head)
        request = w.request
        answers = {
            enc.question_id: build_answer(
                request.questions[enc.question_id], enc.option_ids, p, self.options.confidence
            )
            for enc, p in zip(w.record.questions, probs, strict=True)
        }
        return Decision(
            model=request.model if request.model is not None else self.name,
            answers=answers,
            input_tokens=w.record.input_tokens,
            cache=report,
            calibration=calibration.label if calibration is not None else None,
            timings=RequestTimings(backbone_tokens=tokens),
            probabilities=probs,
            head=head.identity,
        )

    def _store(self, row: _Row, segment: StateSegment, points: dict[int, StatePoint]) -> None:
        """Store what row ``row`` computed from its start in the prefix tree: its segment and its points
        (absolute positions), the image block as a new root when the run began before it."""
        w, at = row.work, row.start_at
        record = w.record
        state_start, state_end = record.state_start, record.state_end
        root_part = None
        if at < state_start:
            root_point = points.get(state_start)
            if root_point is None:
                return  # cannot happen with the planner's points; nothing to hang the state from
            cut = state_start - at
            root_part = (segment.slice(0, cut), root_point)
            if segment.length > cut:
                segment = segment.slice(cut, segment.length)
            at = state_start
        stored = self.state_cache.insert(
            w.root_key,
            record.input_ids[state_start:state_end],
            start=at - state_start,
            segment=segment,
            points={p - state_start: point for p, point in points.items() if p > state_start},
            root_part=root_part,
        )
        if not stored and root_part is None:
            logger.debug("state of %d tokens does not fit the cache budget", state_end)

    def _add_work(
        self, *, backbone_s: float = 0.0, head_s: float = 0.0, vision_s: float = 0.0, tokens: int = 0
    ) -> None:
        with self._work_lock:
            work = self.work
            work.backbone_s += backbone_s
            work.head_s += head_s
            work.vision_s += vision_s
            work.backbone_tokens += tokens

    @contextlib.contextmanager
    def collecting_hidden(self) -> Iterator[dict[int, Tensor]]:
        """Within the block, the whole hidden rows of every request that completes, by ``id`` of its
        `PreparedRequest` (for inspection and tests; one collector at a time)."""
        rows: dict[int, Tensor] = {}
        self._collect = rows
        try:
            yield rows
        finally:
            self._collect = None

    def snapshot_work(self) -> ExecutorWork:
        """A copy of the cumulative work counters."""
        with self._work_lock:
            return replace(self.work)
