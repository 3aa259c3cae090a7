"""``Clef``: the facade users and the server talk to. Load a model, prepare requests, answer them.

One request: `Clef.prepare` (on any thread, no model lock): take the images out of the body, validate it,
decode + preprocess + digest the images, encode the row token-exactly, compute its state-cache key. Then
`Clef.decide_encoded` (one batch at a time, under the model lock):

1. group the batch by state key (``input_ids[:state_end]`` + image pixel digests); look every group up in
   the state cache;
2. cold groups: one representative each, all run together as one right-padded batch continuing the cached
   36-token prompt prefix; the vision tower (loaded on first use) embeds their images; each row's backbone
   state is snapshotted exactly at its own ``state_end`` (the batch is split there) and stored in the cache;
3. every other request (cache hits, and the rest of a group whose state was just computed) runs only its
   schema + suffix, batched per state from a copy of that state;
4. hidden rows = the state's cached rows + the new rows -> lexical rows -> the joint schema head in fp32 ->
   per-question softmax -> System One responses.

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
from clef_runtime.engine.images import (
    ImageEmbedder,
    ImageSettings,
    PreparedImage,
    check_images,
    load_processor_config,
    prepare_images,
    row_positions,
)
from clef_runtime.engine.state_cache import StateCache, state_key
from clef_runtime.model.backbone import Backbone, BackboneState, Continuation
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


_MAX_COLD_SNAPSHOTS = 4
"""Most new states one batched call stores in the state cache (each one splits the batch's calls)."""


def default_cache_bytes(device: torch.device) -> int:
    """The default state-cache budget for ``device``: 10% of the memory available now (host MemAvailable on
    CPU, free GPU memory on CUDA: the cached K/V and DeltaNet states live on the model's device), capped at
    4 GiB."""
    return int(min(DEFAULT_CACHE_CAP, DEFAULT_CACHE_SHARE * available_memory(device)))


@dataclass(frozen=True, eq=False)
class PreparedRequest:
    """A request ready for `Clef.decide_encoded`: the parsed request (images taken out), its encoded row,
    its images preprocessed for the vision tower (in block order) and its state-cache key.

    Build it with `Clef.prepare`. ``input_tokens`` / ``truncated_state_tokens`` mirror the record's, so it
    can stand where an ``EncodedRecord`` is expected for accounting.
    """

    request: SystemOneRequest
    record: EncodedRecord
    images: tuple[PreparedImage, ...] = ()
    state_key: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        check_images(self.record, self.images)
        if not self.state_key:
            key = state_key(self.record.input_ids[: self.record.state_end], (i.digest for i in self.images))
            object.__setattr__(self, "state_key", key)

    @property
    def input_tokens(self) -> int:
        """The number of tokens the model reads (``usage.input_tokens``)."""
        return self.record.input_tokens

    @property
    def truncated_state_tokens(self) -> int:
        """State tokens cut to fit the token limit."""
        return self.record.truncated_state_tokens


#: What `Clef.decide_encoded` accepts per item.
DecisionItem = PreparedRequest | tuple[SystemOneRequest, EncodedRecord | PreparedRequest]


@dataclass
class DecisionTimings:
    """Where the time of the last batch went (seconds) and how much work the backbone did.

    ``backbone_tokens``: tokens that went through the backbone (pads excluded); ``cached_tokens``: tokens of
    the batch's rows that came from a cached or shared state instead (the prompt prefix included);
    ``state_hits`` / ``state_misses``: state groups found in / missing from the cache; ``vision_s``: the
    vision tower's share of ``backbone_s``.
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
    misses: int = 0
    vision_s: float = 0.0


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
        image_mode: str = "native",
        image_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        vision_tower: VisionTower | None = None,
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
        self.state_cache = StateCache(cache_bytes)
        self.options = EngineOptions(
            max_length=max_length,
            prefill_chunk=prefill_chunk,
            pad_last_chunk=pad_last_chunk,
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
        model does not fit; the message says what would), `OptionsError` (a ValueError) for a bad option,
        TypeError for an unknown one, or ``ModelResolutionError`` when a download fails.
        """
        started = time.perf_counter()
        opts = (options or EngineOptions()).replace(**overrides) if overrides else options or EngineOptions()
        ImageSettings(mode=opts.image_mode, max_tokens=opts.image_max_tokens)  # validate before the slow part
        resolved = resolve_model(model)
        if resolved.is_tiny:
            logger.warning("model %r is UNTRAINED (random weights): its answers are meaningless", model)
        info = verify_checkpoint(resolved.path, expected_sizes=resolved.expected_sizes)
        backbone = Backbone.load(
            resolved.path,
            device=opts.device,
            info=info,
            check_memory=opts.check_memory,
            weights=opts.weights,
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
            image_mode=opts.image_mode,
            image_max_tokens=opts.image_max_tokens,
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
        """State-cache counters: ``hits`` / ``misses`` (state lookups, one per distinct state of a batch),
        ``shared`` (requests that reused a state already used by another request of their batch),
        ``stores``, ``evictions``, ``entries``, ``bytes``, ``capacity_bytes``, ``tokens_saved`` (tokens not
        run thanks to a cached or shared state, the 36-token prompt prefix included)."""
        return self.state_cache.stats()

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
        body, sources = extract_images(request) if isinstance(request, dict) else (request, [])
        parsed = parse_request(body)
        images = prepare_images(sources, self.image_settings) if sources else ()
        record = self.encoder.encode(
            parsed, image_token_counts=[image.n_tokens for image in images], max_length=max_length
        )
        return PreparedRequest(request=parsed, record=record, images=images)

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
        probs = self._probabilities(work)
        t0 = time.perf_counter()
        responses = [
            build_response(w.request, w.record, p, self.name, self.options.confidence)
            for w, p in zip(work, probs, strict=True)
        ]
        self.last_timings.answer_s = time.perf_counter() - t0
        return responses

    def probabilities_encoded(self, items: Sequence[DecisionItem]) -> list[list[list[float]]]:
        """Unrounded fp32 probabilities, per item, per question, per option in model order (what
        `decide_encoded` rounds into responses). Same items and errors as `decide_encoded`."""
        work = [self._as_prepared(item) for item in items]
        return self._probabilities(work) if work else []

    def warmup(self) -> None:
        """Run one small request so the first real request does not pay for lazy initialisation."""
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
        )

    def _probabilities(self, work: Sequence[PreparedRequest]) -> list[list[list[float]]]:
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
        return probs

    def _image_rows(self, work: Sequence[PreparedRequest], batch: _BatchWork) -> list[list[Tensor]]:
        """Tower rows of every image of ``work`` (one tower pass for the whole list)."""
        images = [image for w in work for image in w.images]
        if not images:
            return [[] for _ in work]
        started = time.perf_counter()
        rows = self._embedder.embed(images)
        batch.vision_s += time.perf_counter() - started
        out, index = [], 0
        for w in work:
            out.append(rows[index : index + len(w.images)])
            index += len(w.images)
        return out

    def _starts_at_prefix(self, record: EncodedRecord) -> bool:
        prefix = self.prefix_state.length
        return record.input_ids[:prefix] == self.encoder.prefix_ids

    def _hidden_rows(self, work: Sequence[PreparedRequest]) -> tuple[list[Tensor], _BatchWork]:
        """Final-norm rows of every item's full row, reusing and filling the state cache (see the module
        docstring). Runs under the model lock."""
        batch = _BatchWork()
        cache = self.state_cache
        prefix = self.prefix_state
        hiddens: list[Tensor | None] = [None] * len(work)
        groups: dict[bytes, list[int]] = {}
        for index, w in enumerate(work):
            groups.setdefault(w.state_key, []).append(index)

        starts: dict[bytes, BackboneState] = {}
        cold: list[bytes] = []
        for key, members in groups.items():
            record = work[members[0]].record
            if not self._starts_at_prefix(record):  # never for rows from our encoder; kept safe anyway
                raise ValueError("the record does not start with this model's prompt prefix")
            if record.state_end == prefix.length:  # an empty state and no image: the prefix is the state
                starts[key] = prefix
                continue
            found = cache.get(key) if cache.enabled else None
            if found is None:
                cold.append(key)
                batch.misses += 1
            else:
                starts[key] = found  # type: ignore[assignment]
                batch.hits += 1

        if cold:
            # One representative per cold state, all in one batch from the prefix, each snapshotted at its
            # own state_end (extend() splits the calls there) when the state will be stored or shared.
            representatives = [work[groups[key][0]] for key in cold]
            # Every snapshot splits the batched calls at its row's state_end; bound the number of splits so a
            # batch of many different new states stays a few calls (states shared in the batch always split).
            keep = [len(groups[key]) > 1 for key in cold]
            budget = _MAX_COLD_SNAPSHOTS - sum(keep)
            for i in range(len(cold)):
                if not keep[i] and cache.enabled and budget > 0:
                    keep[i] = True
                    budget -= 1
            image_rows = self._image_rows(representatives, batch)
            rows = []
            for w, images, snapshot in zip(representatives, image_rows, keep, strict=True):
                positions = row_positions(w.record, w.images)
                rows.append(
                    Continuation(
                        input_ids=w.record.input_ids[prefix.length :],
                        positions=None if positions is None else positions[:, prefix.length :],
                        image_rows=[
                            (first_pad - prefix.length, image)
                            for (first_pad, _), image in zip(w.record.image_blocks, images, strict=True)
                        ],
                        snapshot_at=w.record.state_end - prefix.length if snapshot else None,
                    )
                )
            results = self.backbone.extend(prefix, rows, prefill_chunk=self.prefill_chunk)
            for key, result in zip(cold, results, strict=True):
                index = groups[key][0]
                hiddens[index] = torch.cat([prefix.hidden, result.hidden])
                batch.tokens_run += work[index].record.input_tokens - prefix.length
                batch.tokens_cached += prefix.length
                if result.snapshot is None:
                    continue
                starts[key] = result.snapshot
                if cache.enabled and not cache.put(key, result.snapshot):
                    logger.debug("state of %d tokens is larger than the cache budget", result.snapshot.length)

        for key, members in groups.items():
            todo = [index for index in members if hiddens[index] is None]
            if not todo:
                continue
            start = starts[key]
            rows = []
            for index in todo:
                record = work[index].record
                positions = row_positions(record, work[index].images)
                if positions is not None:
                    if not bool((positions[:, start.length] == start.next_position).all()):
                        raise RuntimeError("a cached state's next position does not match the request's row")
                    positions = positions[:, start.length :]
                rows.append(Continuation(input_ids=record.input_ids[start.length :], positions=positions))
            results = self.backbone.extend(start, rows, prefill_chunk=self.prefill_chunk)
            for index, result in zip(todo, results, strict=True):
                hiddens[index] = torch.cat([start.hidden, result.hidden])
                batch.tokens_run += work[index].record.input_tokens - start.length
                batch.tokens_cached += start.length
            if start is not prefix:
                shared = len(todo) - (0 if key in cold else 1)
                if shared:
                    cache.add_shared(shared)
        saved = batch.tokens_cached
        if saved:
            cache.add_saved(saved)
        complete = [h for h in hiddens if h is not None]
        assert len(complete) == len(work)
        return complete, batch

    def _hidden_rows_seed_form(self, work: Sequence[PreparedRequest]) -> tuple[list[Tensor], _BatchWork]:
        """The seed's readout: one row at a time from zero states in ``prefill_chunk``-token calls, the last
        call padded with ``<|endoftext|>``; no state cache."""
        batch = _BatchWork()
        image_rows = self._image_rows(work, batch)
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
