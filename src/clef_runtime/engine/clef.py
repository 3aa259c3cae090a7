"""``Clef``: the facade users and the server talk to. Load a model, prepare requests, answer them.

One request: `Clef.prepare` (on any thread, no model lock): take the images out of the body, validate it,
decode + preprocess + digest the images, encode the row token-exactly, compute its state-cache key. Then
`Clef.decide_encoded` (one batch at a time, under the model lock):

1. look every distinct state up in the state cache, a prefix tree over the state's ids
   (`clef_runtime.engine.state_cache`): the longest cached prefix of the state is where the row resumes;
2. plan the batch (`clef_runtime.engine.planning`, pure): rows with the same state are computed once; rows
   that resume at the same cached point run together as one right-padded batch, each from there to its
   end, snapshotted where the plan says (state end, fixed boundaries, before the unstable tail, after the
   image block; the calls are split there); the vision tower (loaded on first use) embeds the images of
   rows that start before their image block;
3. execute: runs first, their snapshots stored in the tree; then the rows whose whole state is cached or
   was just computed by another row run only their schema + suffix, batched per state;
4. hidden rows = the start state's rows + the new rows -> lexical rows -> the joint schema head in fp32 ->
   per-question softmax -> System One responses, each with what the cache did for it (``x_state_cache``,
   ``usage.input_tokens_details.cached_tokens``).

Nothing of one request is kept on the model for the next: positions are passed explicitly, caches are
fresh copies, and cached states are never modified.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from clef_runtime.encoding.encoder import DEFAULT_MAX_LENGTH, EncodedRecord, Encoder
from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
from clef_runtime.encoding.tokenizer import ClefTokenizer
from clef_runtime.engine.answers import build_response
from clef_runtime.engine.calibration import Calibration
from clef_runtime.engine.images import (
    ImageEmbedder,
    ImageSettings,
    PreparedImage,
    load_processor_config,
    row_positions,
)
from clef_runtime.engine.planning import MAX_SNAPSHOT_ROWS, Plan, PlanRow, RowReport, plan_batch
from clef_runtime.engine.preparer import PreparedRequest, RequestPreparer
from clef_runtime.engine.state_cache import TEXT_ROOT, Match, StateCache
from clef_runtime.model.backbone import Backbone, BackboneState, Continuation, StatePoint, StateSegment
from clef_runtime.model.checkpoint import verify_checkpoint
from clef_runtime.model.head import HeadLayout, JointSchemaHead, probabilities
from clef_runtime.model.kernels import flush_denormals
from clef_runtime.model.lexical import LexicalTable
from clef_runtime.model.memory import available_memory
from clef_runtime.model.resolve import ResolvedModel, resolve_model
from clef_runtime.options import EngineOptions
from clef_runtime.protocol.images import extract_images
from clef_runtime.protocol.systemone import SystemOneRequest, parse_request
from clef_runtime.vision.preprocess import DEFAULT_MAX_TOKENS
from clef_runtime.vision.tower import VisionTower

__all__ = ["Clef", "DecisionItem", "DecisionTimings", "PreparedRequest", "default_cache_bytes"]

logger = logging.getLogger("clef_runtime.engine")

CLEF_FLASH_RELEASE_DATE = "2026-10-01"
TINY_DESCRIPTION = (
    "tiny: an UNTRAINED Clef checkpoint with random weights in the release layout, for tests and demos; "
    "its answers are meaningless"
)

#: The default state-cache budget: this share of the memory available at load, at most DEFAULT_CACHE_CAP.
DEFAULT_CACHE_SHARE = 0.10
DEFAULT_CACHE_CAP = 4 * 1024**3


_MAX_SNAPSHOT_ROWS = MAX_SNAPSHOT_ROWS
"""Most rows of one batched call that store snapshots in the state cache (each one splits the calls)."""

_PREFIX_START = "prompt-prefix"
"""The planner's start identity of rows that resume at the prompt prefix."""

_MISS = RowReport("miss", 0)


def default_cache_bytes(device: torch.device) -> int:
    """The default state-cache budget for ``device``: 10% of the memory available now (host MemAvailable on
    CPU, free GPU memory on CUDA: the cached K/V and DeltaNet states live on the model's device), capped at
    4 GiB."""
    return int(min(DEFAULT_CACHE_CAP, DEFAULT_CACHE_SHARE * available_memory(device)))


#: What `Clef.decide_encoded` accepts per item.
DecisionItem = PreparedRequest | tuple[SystemOneRequest, EncodedRecord | PreparedRequest]


@dataclass
class DecisionTimings:
    """Where the time of the last batch went (seconds) and how much work the backbone did.

    ``backbone_tokens``: tokens that went through the backbone (pads excluded); ``cached_tokens``: tokens of
    the batch's rows that came from a cached or shared state instead (the prompt prefix included);
    ``state_hits`` / ``state_partials`` / ``state_misses``: distinct states of the batch found whole, found in
    part (a cached prefix), not found; ``vision_s``: the vision tower's share of ``backbone_s``.
    """

    backbone_s: float = 0.0
    head_s: float = 0.0
    answer_s: float = 0.0
    vision_s: float = 0.0
    batch_size: int = 0
    backbone_tokens: int = 0
    cached_tokens: int = 0
    state_hits: int = 0
    state_misses: int = 0
    state_partials: int = 0


@dataclass
class _Counters:
    backbone_tokens: int = 0
    batches: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _BatchWork:
    """Per-batch bookkeeping of `Clef._hidden_rows`."""

    tokens_run: int = 0
    tokens_cached: int = 0
    hits: int = 0
    partials: int = 0
    misses: int = 0
    vision_s: float = 0.0
    reports: list[RowReport] = field(default_factory=list)


def _layout(record: EncodedRecord) -> HeadLayout:
    return HeadLayout(
        type_ids=[q.type_id for q in record.questions],
        question_spans=[q.question_span for q in record.questions],
        option_spans=[list(q.option_spans) for q in record.questions],
    )


class Clef:
    """A loaded Clef model. Thread-safe: the model runs one batch at a time under a lock; `prepare`,
    `parse` and `encode` run on any thread without it."""

    def __init__(
        self,
        *,
        resolved: ResolvedModel,
        tokenizer: ClefTokenizer,
        backbone: Backbone,
        head: JointSchemaHead,
        lexical: LexicalTable,
        max_length: int = DEFAULT_MAX_LENGTH,
        prefill_chunk: int | None = None,
        pad_last_chunk: bool = False,
        cache_bytes: int = 0,
        snapshot_interval: int = EngineOptions.snapshot_interval,
        image_mode: str = "native",
        image_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        vision_tower: VisionTower | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        self.resolved = resolved
        self.tokenizer = tokenizer
        self.backbone = backbone
        self.head = head
        self.lexical = lexical
        self.max_length = max_length
        self.prefill_chunk = prefill_chunk
        self.pad_last_chunk = pad_last_chunk
        self.encoder = Encoder(tokenizer_for_encoding(tokenizer), max_length=max_length)
        self.image_settings = ImageSettings(
            mode=image_mode,
            max_tokens=image_max_tokens,
            processor_config=load_processor_config(resolved.path),
        )
        if vision_tower is None:
            vision_tower = VisionTower(resolved.path, device=backbone.device, dtype=backbone.dtype)
        self.vision_tower = vision_tower
        self._embedder = ImageEmbedder(vision_tower)
        self.preparer = RequestPreparer(self.encoder, self.image_settings)
        self.state_cache = StateCache(cache_bytes)
        if snapshot_interval < 0:
            raise ValueError(f"snapshot_interval must be >= 0, got {snapshot_interval}")
        self.snapshot_interval = snapshot_interval
        self.calibration = calibration
        """Temperatures applied to every question's probabilities before its answer is built (None: off)."""
        self.calibration_card = calibration.describe() if calibration is not None else None
        self.options = EngineOptions(
            max_length=max_length,
            prefill_chunk=prefill_chunk,
            pad_last_chunk=pad_last_chunk,
            snapshot_interval=snapshot_interval,
            image_mode=image_mode,
            image_max_tokens=image_max_tokens,
            cache_mb=cache_bytes / (1024 * 1024),
        )
        """The options this engine was loaded with (`load` sets the full set)."""
        self.untrained = resolved.is_tiny
        self.name = resolved.name
        self.description = (
            TINY_DESCRIPTION if self.untrained else f"{resolved.name}: Cloudflare's Clef decision model"
        )
        self.release_date = "2026-11-29" if self.untrained else CLEF_FLASH_RELEASE_DATE
        self.last_timings = DecisionTimings()
        self.device = str(backbone.device)
        """Where the model runs (``cpu``, ``cuda:0``)."""
        self.weight_mode = backbone.weight_mode
        """How the backbone's weights are stored (``fp32``, ``bf16-storage``, ``int8``, ...)."""
        self._counters = _Counters()
        self._model_lock = threading.Lock()
        # The constant prompt prefix is the starting point of every cold row: computed once, kept for good
        # (outside the LRU budget; a few KB per token).
        self.prefix_state: BackboneState = backbone.initial_state(self.encoder.prefix_ids)

    # ------------------------------------------------------------------------------------------ loading

    @classmethod
    def load(cls, model: str = "tiny", options: EngineOptions | None = None, **overrides: Any) -> Clef:
        """Load ``model``: ``"tiny"``, a local release directory, or a Hugging Face repo id with an optional
        ``@revision``. Nothing from the checkpoint is executed; weights come from safetensors only.

        ``options``: an `EngineOptions` (default: all defaults); ``overrides``: any of its fields by name
        (``Clef.load("tiny", cache_mb=0, weights="fp32")``), applied on top. See `EngineOptions` for what
        each does; the same options are the CLI flags and ``CLEF_*`` variables of ``clef decide / serve``.

        Raises ``CheckpointError`` (a missing or malformed file, named), ``InsufficientMemoryError`` (the
        model does not fit; the message says what would), `OptionsError` (a ValueError) for a bad option
        or calibration file (``CalibrationError``, checked before anything loads),
        TypeError for an unknown one, or ``ModelResolutionError`` when a download fails.
        """
        started = time.perf_counter()
        opts = (options or EngineOptions()).replace(**overrides) if overrides else options or EngineOptions()
        ImageSettings(mode=opts.image_mode, max_tokens=opts.image_max_tokens)  # validate before the slow part
        calibration = Calibration.load(opts.calibration) if opts.calibration else None
        resolved = resolve_model(model)
        if resolved.is_tiny:
            logger.warning("model %r is untrained (random weights): its answers are meaningless", model)
        info = verify_checkpoint(resolved.path, expected_sizes=resolved.expected_sizes)
        backbone = Backbone.load(
            resolved.path,
            device=opts.device,
            info=info,
            check_memory=opts.check_memory,
            weights=opts.weights,
            int8_layers=opts.int8_layers,
            fused_kernels=opts.fused_kernels,
        )
        tokenizer = ClefTokenizer.load(resolved.path)
        head = JointSchemaHead.from_files(resolved.path, device=backbone.device)
        lexical = LexicalTable.from_safetensors(resolved.path)
        cache_bytes = (
            default_cache_bytes(backbone.device)
            if opts.cache_mb is None
            else int(opts.cache_mb * 1024 * 1024)
        )
        clef = cls(
            resolved=resolved,
            tokenizer=tokenizer,
            backbone=backbone,
            head=head,
            lexical=lexical,
            max_length=opts.max_length,
            prefill_chunk=opts.prefill_chunk,
            pad_last_chunk=opts.pad_last_chunk,
            cache_bytes=cache_bytes,
            snapshot_interval=opts.snapshot_interval,
            image_mode=opts.image_mode,
            image_max_tokens=opts.image_max_tokens,
            calibration=calibration,
        )
        clef.options = opts
        logger.info(
            "loaded %s from %s on %s in %.1f s (weights %s, state cache %.0f MiB)",
            resolved.name,
            resolved.path,
            backbone.device,
            time.perf_counter() - started,
            backbone.weight_mode,
            cache_bytes / 1024**2,
        )
        return clef

    @property
    def path(self) -> Path:
        """The checkpoint directory."""
        return self.resolved.path

    @property
    def backbone_tokens(self) -> int:
        """Tokens that went through the backbone since load (cached or shared state tokens and pads are not
        counted)."""
        return self._counters.backbone_tokens

    def cache_stats(self) -> dict[str, int]:
        """State-cache counters: ``hits`` / ``partials`` / ``misses`` (one per distinct state of a batch:
        found whole, found in part, not found), ``shared`` (requests that reused a state computed by another
        request of their batch), ``stores`` (snapshots stored), ``evictions`` (tree nodes), ``entries``
        (tree nodes), ``points`` (resumable positions), ``bytes``, ``capacity_bytes``, ``tokens_saved``
        (tokens not run thanks to a cached or shared state, the 36-token prompt prefix included),
        ``reused_tokens`` (image and state tokens taken from the cache, summed over requests)."""
        return self.state_cache.stats()

    def replica_status(self) -> None:
        """None: this engine computes in this process (no replicas)."""
        return None

    def prepare_compute_thread(self) -> None:
        """Start the calling thread's CPU thread team (with flush-to-zero) before it runs the model: call it
        on the thread that will run every `decide_encoded` (the server's batcher does). Without it the team
        is started by the first request, and a team another live thread started first slows both (see
        `clef_runtime.model.kernels.configure_cpu_threads`). No-op off CPU."""
        if self.backbone.device.type == "cpu":
            from clef_runtime.model.kernels import start_thread_pool

            start_thread_pool()

    def clear_cache(self) -> None:
        """Drop every cached state (the prompt prefix stays)."""
        self.state_cache.clear()

    # ------------------------------------------------------------------------------------------ requests

    def parse(self, request: Any) -> SystemOneRequest:
        """Validate a request body (its images' wire format too) and return it without its images (they
        are not part of ``SystemOneRequest``; use `prepare` to keep them). Raises ``RequestValidationError``.
        """
        body, _ = extract_images(request) if isinstance(request, dict) else (request, [])
        return parse_request(body)

    def prepare(self, request: Any, *, max_length: int | None = None) -> PreparedRequest:
        """Everything before the model, for one request body (a JSON-decoded dict, possibly with images in
        ``images`` or in the ``state`` array) or an already parsed ``SystemOneRequest`` (text only): take
        the images out, validate, decode and preprocess the images in the configured mode, encode the row
        token-exactly, compute the state-cache key. No model lock; the vision tower is not touched.

        Returns a `PreparedRequest`. Raises ``RequestValidationError`` (bad body, bad image: the error names
        the image) or ``InputTooLongError`` (the schema with its images does not fit ``max_length``).
        """
        return self.preparer.prepare(request, max_length=max_length)

    def encode(self, request: Any, *, max_length: int | None = None) -> EncodedRecord:
        """Encode a request token-exactly as the reference (image blocks included: images are decoded and
        preprocessed to know their token counts); returns the ``EncodedRecord``. Raises
        ``RequestValidationError`` or ``InputTooLongError``."""
        return self.prepare(request, max_length=max_length).record

    def decide(self, request: Any) -> dict[str, Any]:
        """Answer one request (text and images); returns the System One response dict. Raises
        ``RequestValidationError`` / ``InputTooLongError`` for bad input."""
        return self.decide_encoded([self.prepare(request)])[0]

    def decide_encoded(self, items: Sequence[DecisionItem]) -> list[dict[str, Any]]:
        """Answer several prepared requests as one batch; one System One response per item, in order.

        An item is a `PreparedRequest` (from `prepare`: the only form that can carry images), or a tuple
        ``(request, record)`` with ``record`` an ``EncodedRecord`` of a text-only request or a
        `PreparedRequest` (then ``request`` is ignored in favour of its own). Raises ValueError for a
        record with image blocks but no images; the batch fails as a whole (the server retries items
        alone).
        """
        work = [self._as_prepared(item) for item in items]
        if not work:
            return []
        probs, reports = self._scored(work)
        t0 = time.perf_counter()
        probs = self._calibrated(work, probs)
        responses = []
        for w, p, report in zip(work, probs, reports, strict=True):
            response = build_response(w.request, w.record, p, self.name, self.options.confidence)
            response["usage"]["input_tokens_details"] = {"cached_tokens": report.cached_tokens}
            response["x_state_cache"] = report.status
            if self.calibration is not None:
                response["x_calibration"] = self.calibration.label
            responses.append(response)
        self.last_timings.answer_s = time.perf_counter() - t0
        return responses

    def probabilities_encoded(self, items: Sequence[DecisionItem]) -> list[list[list[float]]]:
        """Unrounded probabilities, per item, per question, per option in model order (what
        `decide_encoded` rounds into responses: calibrated when the engine has a calibration). Same items and
        errors as `decide_encoded`."""
        work = [self._as_prepared(item) for item in items]
        return self._calibrated(work, self._scored(work)[0]) if work else []

    def warmup(self, *, max_batch_tokens: int = 16384, max_batch_size: int = 32) -> None:
        """Run one small request so the first real request does not pay for lazy initialisation; on CUDA
        also every batch shape the server can form within ``max_batch_tokens`` / ``max_batch_size`` (the
        server's defaults), so Triton autotuning happens now (see `clef_runtime.engine.warmup`)."""
        from clef_runtime.engine.warmup import run_backbone_warmup, warmup_shapes

        shapes = warmup_shapes(
            self.backbone.device.type, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size
        )
        if shapes:
            started = time.perf_counter()
            with self._model_lock, torch.inference_mode():
                tokens = run_backbone_warmup(self.backbone, self.prefix_state, shapes)
            logger.info(
                "warm-up: %d batch shapes, %d tokens in %.1f s",
                len(shapes),
                tokens,
                time.perf_counter() - started,
            )
        self.decide(
            {
                "state": "warm-up",
                "questions": {
                    "w": {"type": "choice", "criteria": {"a": None, "b": None}},
                    "s": {"type": "score", "criteria": ["low", "high"]},
                },
            }
        )

    # ------------------------------------------------------------------------------------------ internals

    def _calibrated(
        self, work: Sequence[PreparedRequest], probs: list[list[list[float]]]
    ) -> list[list[list[float]]]:
        """``probs`` with the calibration's temperatures applied per question (unchanged without one)."""
        calibration = self.calibration
        if calibration is None:
            return probs
        return [
            [
                calibration.apply(q.question_id, q.question_type, p)
                for q, p in zip(w.record.questions, item, strict=True)
            ]
            for w, item in zip(work, probs, strict=True)
        ]

    @staticmethod
    def _as_prepared(item: Any) -> PreparedRequest:
        if isinstance(item, PreparedRequest):
            return item
        if isinstance(item, tuple) and len(item) == 2:
            request, record = item
            if isinstance(record, PreparedRequest):
                return record
            if isinstance(record, EncodedRecord):
                # PreparedRequest checks that a record with image blocks does not come without its images.
                return PreparedRequest(request=request, record=record)
        raise TypeError(
            f"decide_encoded items are PreparedRequest or (request, EncodedRecord) tuples, got {type(item)}"
        )

    def hidden_rows(self, items: Sequence[DecisionItem]) -> list[Tensor]:
        """The backbone's final-norm rows of every item's whole row, fp32 CPU [T_i, hidden] each, computed
        exactly as `decide_encoded` does (state cache included). Same items and errors as
        `decide_encoded`."""
        work = [self._as_prepared(item) for item in items]
        if not work:
            return []
        with self._model_lock, flush_denormals(), torch.inference_mode():
            started = time.perf_counter()
            hiddens, batch = self._run_backbone(work)
            self._account(work, batch, backbone_s=time.perf_counter() - started, head_s=0.0)
        return hiddens

    def _run_backbone(self, work: Sequence[PreparedRequest]) -> tuple[list[Tensor], _BatchWork]:
        if self.pad_last_chunk:
            return self._hidden_rows_seed_form(work)
        return self._hidden_rows(work)

    def _account(
        self, work: Sequence[PreparedRequest], batch: _BatchWork, *, backbone_s: float, head_s: float
    ) -> None:
        with self._counters.lock:
            self._counters.backbone_tokens += batch.tokens_run
            self._counters.batches += 1
            self._counters.requests += len(work)
        self.last_timings = DecisionTimings(
            backbone_s=backbone_s,
            head_s=head_s,
            vision_s=batch.vision_s,
            batch_size=len(work),
            backbone_tokens=batch.tokens_run,
            cached_tokens=batch.tokens_cached,
            state_hits=batch.hits,
            state_misses=batch.misses,
            state_partials=batch.partials,
        )

    def _probabilities(self, work: Sequence[PreparedRequest]) -> list[list[list[float]]]:
        return self._scored(work)[0]

    def _scored(self, work: Sequence[PreparedRequest]) -> tuple[list[list[list[float]]], list[RowReport]]:
        """Probabilities of every item, and what the state cache did for each."""
        records = [w.record for w in work]
        with self._model_lock, flush_denormals(), torch.inference_mode():
            t0 = time.perf_counter()
            hiddens, batch = self._run_backbone(work)
            t1 = time.perf_counter()
            layouts = [_layout(r) for r in records]
            lexicals = [
                self.lexical.option_means(r.input_ids, [s for q in r.questions for s in q.option_spans])
                for r in records
            ]
            logits = self.head.score_batch(hiddens, layouts, lexicals)
            probs = [
                [p.tolist() for p in probabilities(lg, lay)] for lg, lay in zip(logits, layouts, strict=True)
            ]
            self._account(work, batch, backbone_s=t1 - t0, head_s=time.perf_counter() - t1)
        return probs, batch.reports

    def _image_rows(
        self, image_lists: Sequence[Sequence[PreparedImage]], batch: _BatchWork
    ) -> list[list[Tensor]]:
        """Tower rows of every image of every list (one tower pass for them all), per list."""
        images = [image for images in image_lists for image in images]
        if not images:
            return [[] for _ in image_lists]
        started = time.perf_counter()
        rows = self._embedder.embed(images)
        batch.vision_s += time.perf_counter() - started
        out, index = [], 0
        for own in image_lists:
            out.append(rows[index : index + len(own)])
            index += len(own)
        return out

    def _starts_at_prefix(self, record: EncodedRecord) -> bool:
        prefix = self.prefix_state.length
        return record.input_ids[:prefix] == self.encoder.prefix_ids

    def _hidden_rows(self, work: Sequence[PreparedRequest]) -> tuple[list[Tensor], _BatchWork]:
        """Final-norm rows of every item's full row, resuming from and filling the state cache (see the
        module docstring): look up, plan, execute. Runs under the model lock."""
        batch = _BatchWork()
        rows, starts = self._lookup(work)
        plan = plan_batch(
            rows,
            prefix_length=self.prefix_state.length,
            store=self.state_cache.enabled,
            snapshot_interval=self.snapshot_interval,
            max_snapshot_rows=_MAX_SNAPSHOT_ROWS,
        )
        hiddens = self._execute(plan, work, starts, batch)
        batch.hits, batch.partials, batch.misses = plan.hits, plan.partials, plan.misses
        batch.reports = list(plan.reports)
        cache = self.state_cache
        if cache.enabled:
            for status, count in (("hit", plan.hits), ("partial", plan.partials), ("miss", plan.misses)):
                if count:
                    cache.record(status, count)
        if plan.shared:
            cache.add_shared(plan.shared)
        reused = sum(report.cached_tokens for report in plan.reports)
        if batch.tokens_cached or reused:
            cache.add_saved(batch.tokens_cached, reused)
        return hiddens, batch

    def _lookup(self, work: Sequence[PreparedRequest]) -> tuple[list[PlanRow], dict[Any, BackboneState]]:
        """The planner's view of every row (where it can resume) and the restored start states by start
        identity."""
        prefix = self.prefix_state
        starts: dict[Any, BackboneState] = {_PREFIX_START: prefix}
        found: dict[bytes, Match] = {}
        rows = []
        for w in work:
            record = w.record
            if not self._starts_at_prefix(record):  # never for rows from our encoder; kept safe anyway
                raise ValueError("the record does not start with this model's prompt prefix")
            match = found.get(w.state_key)
            if match is None:
                match = Match(root=w.root_key == TEXT_ROOT, length=0)
                if self.state_cache.enabled:
                    state_ids = record.input_ids[record.state_start : record.state_end]
                    match = self.state_cache.lookup(w.root_key, state_ids)
                found[w.state_key] = match
            resume_at = record.state_start + match.length if match.root else prefix.length
            start: Any = _PREFIX_START
            if resume_at > prefix.length:
                start = match.start
                if start not in starts:
                    assert isinstance(match.point, StatePoint)
                    starts[start] = prefix.assemble(match.segments, match.point)  # type: ignore[arg-type]
            rows.append(
                PlanRow(
                    state_key=w.state_key,
                    state_start=record.state_start,
                    state_end=record.state_end,
                    resume_at=resume_at,
                    start=start,
                    tail_at=w.tail_at,
                    images=bool(record.image_blocks),
                )
            )
        return rows, starts

    def _execute(
        self,
        plan: Plan,
        work: Sequence[PreparedRequest],
        starts: dict[Any, BackboneState],
        batch: _BatchWork,
    ) -> list[Tensor]:
        """Run ``plan``: its runs (storing their snapshots), then its finishes. Returns the hidden rows."""
        hiddens: list[Tensor | None] = [None] * len(work)
        ends: dict[int, BackboneState] = {}  # state ends computed here, by representative row
        sources = {finish.source for finish in plan.finishes if finish.source is not None}
        for run in plan.runs:
            start = starts[run.start]
            members = [work[row.row] for row in run.rows]
            # Images are embedded only for rows that start before their image block.
            image_rows = self._image_rows(
                [w.images if run.start_at < w.record.state_start else () for w in members], batch
            )
            rows = [
                self._continuation(
                    w, start, run.start_at, images, tuple(p - run.start_at for p in row.points)
                )
                for w, images, row in zip(members, image_rows, run.rows, strict=True)
            ]
            results = self.backbone.extend(start, rows, prefill_chunk=self.prefill_chunk)
            for row, w, result in zip(run.rows, members, results, strict=True):
                hiddens[row.row] = torch.cat([start.hidden, result.hidden])
                batch.tokens_run += w.record.input_tokens - run.start_at
                batch.tokens_cached += run.start_at
                if not row.points:
                    continue
                assert result.segment is not None
                points = dict(zip(row.points, result.points, strict=True))
                if row.store:
                    self._store(w, run.start_at, result.segment, points)
                if row.row in sources:
                    ends[row.row] = start.assemble([result.segment], points[w.record.state_end])

        for finish in plan.finishes:
            start = ends[finish.source] if finish.start is None else starts[finish.start]  # type: ignore[index]
            members = [work[index] for index in finish.rows]
            rows = [self._continuation(w, start, finish.at, [], ()) for w in members]
            results = self.backbone.extend(start, rows, prefill_chunk=self.prefill_chunk)
            for index, w, result in zip(finish.rows, members, results, strict=True):
                hiddens[index] = torch.cat([start.hidden, result.hidden])
                batch.tokens_run += w.record.input_tokens - finish.at
                batch.tokens_cached += finish.at
        complete = [h for h in hiddens if h is not None]
        assert len(complete) == len(work)
        return complete

    def _continuation(
        self,
        w: PreparedRequest,
        start: BackboneState,
        at: int,
        images: Sequence[Tensor],
        points: tuple[int, ...],
    ) -> Continuation:
        """Row ``w`` from position ``at`` (where ``start`` ends) to its end; ``images``: tower rows of its
        images when ``at`` is before its image block; ``points``: snapshot offsets from ``at``."""
        record = w.record
        if start.length != at:
            raise RuntimeError(f"a start state of {start.length} tokens cannot resume a row at {at}")
        positions = row_positions(record, w.images)
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
            points=points,
        )

    def _store(
        self, w: PreparedRequest, at: int, segment: StateSegment, points: dict[int, StatePoint]
    ) -> None:
        """Store what a run from position ``at`` computed for row ``w`` in the prefix tree: its segment
        and its points (absolute positions), the image block as a new root when the run began before it."""
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

    def _hidden_rows_seed_form(self, work: Sequence[PreparedRequest]) -> tuple[list[Tensor], _BatchWork]:
        """The seed's readout: one row at a time from zero states in ``prefill_chunk``-token calls, the last
        call padded with ``<|endoftext|>``; no state cache."""
        batch = _BatchWork(reports=[_MISS] * len(work))
        image_rows = self._image_rows([w.images for w in work], batch)
        hiddens = []
        for w, images in zip(work, image_rows, strict=True):
            embeds = self.backbone.embeddings(
                w.record.input_ids,
                image_rows=[
                    (first_pad, image)
                    for (first_pad, _), image in zip(w.record.image_blocks, images, strict=True)
                ],
            )
            hiddens.append(
                self.backbone.hidden_states(
                    w.record.input_ids,
                    prefill_chunk=self.prefill_chunk,
                    pad_last_chunk=True,
                    position_ids=row_positions(w.record, w.images),
                    inputs_embeds=embeds,
                )
            )
            batch.tokens_run += w.record.input_tokens
        return hiddens, batch
