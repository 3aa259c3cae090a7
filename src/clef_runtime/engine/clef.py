"""``Clef``: the facade users and the server talk to. Load a model, prepare requests, answer them.

One request: `Clef.prepare` (on any thread, no model lock): take the images out of the body, validate it,
decode + preprocess + digest the images, encode the row token-exactly, compute its state-cache key. Then the
engine answers it in steps (`clef_runtime.engine.loop`, driven by `clef_runtime.engine.policy`) over the
executor (`clef_runtime.engine.executor`: the state-cache driver and the step runner): the server runs one
`EngineLoop` on its own thread (`Clef.runner`), and `Clef.decide_encoded` runs the same steps on the calling
thread for a list of requests. Each request's answer is a typed `Decision`; `Decision.body` is its System One
response.

A `Clef` is a `LoadedModel` (weights, tokenizer, head, lexical table, vision tower) plus `EngineOptions`;
two engines can share one loaded model with different options (each has its own state cache).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from clef_runtime.encoding.encoder import EncodedRecord, Encoder
from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
from clef_runtime.encoding.tokenizer import ClefTokenizer, TokenizerLoadError
from clef_runtime.engine.calibration import Calibration, CalibrationError
from clef_runtime.engine.card import CardedEngine, EngineCard
from clef_runtime.engine.decision import Decision
from clef_runtime.engine.executor import StepExecutor
from clef_runtime.engine.head_records import HeadInfo, HeadRefusedError
from clef_runtime.engine.heads import HeadSet, ServedHead, check_head_names, load_head
from clef_runtime.engine.images import ImageEmbedder, ImageSettings, load_processor_config
from clef_runtime.engine.independent import IndependentRequest, submit_parts
from clef_runtime.engine.loop import EngineLoop
from clef_runtime.engine.policy import DEFAULT_STEP_ROWS, StepSettings, build_step_settings
from clef_runtime.engine.preflight import EngineFiles, check_engine_files
from clef_runtime.engine.preparer import PreparedRequest, RequestPreparer
from clef_runtime.engine.state_cache import StateCache
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import CheckpointError, model_card, verify_checkpoint
from clef_runtime.model.head import HeadLoadError, JointSchemaHead
from clef_runtime.model.lexical import LexicalTable
from clef_runtime.model.memory import available_memory
from clef_runtime.model.resolve import ResolvedModel, resolve_model
from clef_runtime.model.state import BackboneState
from clef_runtime.options import HEAD_NAME, EngineOptions, parse_head_specs
from clef_runtime.protocol.explain import ExplainOptions, checked_explain
from clef_runtime.protocol.images import parse_with_images
from clef_runtime.protocol.systemone import SystemOneRequest
from clef_runtime.release import TOKENIZER_FILE
from clef_runtime.vision.tower import VisionTower

__all__ = [
    "Clef",
    "DecisionItem",
    "DecisionTimings",
    "ExplainArgument",
    "LoadedModel",
    "PreparedRequest",
    "default_cache_bytes",
    "default_step_tokens",
    "with_explain",
]

logger = logging.getLogger("clef_runtime.engine")

#: The default state-cache budget: this share of the memory available at load, at most DEFAULT_CACHE_CAP.
DEFAULT_CACHE_SHARE = 0.10
DEFAULT_CACHE_CAP = 4 * 1024**3

#: The default token budget of one engine step, by device type (ARCHITECTURE.md, "The step budget": on CPU a
#: long row gains nothing from company and a small step lets short requests in after ~one chunk; on CUDA
#: throughput comes from packing many requests' tokens into one step).
DEFAULT_STEP_TOKENS = {"cpu": 1024, "cuda": 16384}

MiB = 1024 * 1024


def _checkpoint_tokenizer(directory: Path) -> ClefTokenizer:
    """The checkpoint's tokenizer; a malformed ``tokenizer.json`` is a `CheckpointError` naming it, as every
    other damaged release file is."""
    try:
        return ClefTokenizer.load(directory)
    except TokenizerLoadError as error:
        raise CheckpointError(str(error), file=directory / TOKENIZER_FILE) from error


def default_cache_bytes(device: torch.device) -> int:
    """The default state-cache budget for ``device``: 10% of the memory available now (host MemAvailable on
    CPU, free GPU memory on CUDA: the cached K/V and DeltaNet states live on the model's device), capped at
    4 GiB."""
    return int(min(DEFAULT_CACHE_CAP, DEFAULT_CACHE_SHARE * available_memory(device)))


def default_step_tokens(device: torch.device) -> int:
    """The default token budget of one engine step on ``device`` (`DEFAULT_STEP_TOKENS`; other devices take
    CUDA's)."""
    return DEFAULT_STEP_TOKENS.get(device.type, DEFAULT_STEP_TOKENS["cuda"])


#: What `Clef.prepare` returns: one prepared row, or one per question of an ``x_independent`` request.
Prepared = PreparedRequest | IndependentRequest[PreparedRequest]

#: What `Clef.decide_encoded` accepts per item.
DecisionItem = Prepared | tuple[SystemOneRequest, EncodedRecord | PreparedRequest]

#: `Clef.decide`'s ``explain``: None leaves the request's own ``x_explain``; False turns it off; True, an
#: ``x_explain`` object or `ExplainOptions` turns it on.
ExplainArgument = bool | dict[str, Any] | ExplainOptions | None


def with_explain(request: Any, explain: ExplainArgument) -> Any:
    """``request`` (a body dict or a parsed `SystemOneRequest`) with its ``x_explain`` set from ``explain``
    (None: unchanged; anything else neither a dict nor a request is returned as it is, for `Clef.prepare`
    to refuse). Raises ``RequestValidationError`` naming ``x_explain.top_k`` and so on for a bad value."""
    if explain is None:
        return request
    options = checked_explain(explain)
    if isinstance(request, SystemOneRequest):
        return request.model_copy(update={"x_explain": options})
    if isinstance(request, dict):
        body = {key: value for key, value in request.items() if key != "x_explain"}
        if options is not None:
            body["x_explain"] = options.model_dump()
        return body
    return request


@dataclass
class DecisionTimings:
    """Where the time of the last synchronous call (`Clef.decide_encoded`, `hidden_rows`) went (seconds) and
    how much work the backbone did. The server's loop does not set it: its figures are per request
    (`Decision.timings`).

    ``backbone_tokens``: tokens that went through the backbone (pads excluded); ``cached_tokens``: tokens of
    the requests that came from a cached or shared state instead (the prompt prefix included);
    ``state_hits`` / ``state_partials`` / ``state_misses``: requests whose state was found whole (in the
    cache, or computed by another request just before), in part, not at all; ``vision_s``: the vision
    tower's share of ``backbone_s``.
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
    steps: int = 0


@dataclass(frozen=True)
class LoadedModel:
    """The parts of a loaded release: what `Clef.load` reads once and engines share."""

    resolved: ResolvedModel
    tokenizer: ClefTokenizer
    backbone: Backbone
    head: JointSchemaHead
    lexical: LexicalTable
    vision_tower: VisionTower
    head_digest: str | None = None
    """The release head's identity when it was built in memory (no ``joint_head.*`` files to hash, e.g. a
    random model of the release's geometry built on the device); None: hashed from the checkpoint's files."""


class Clef(CardedEngine):
    """A loaded Clef model with its options. Thread-safe: the model runs one step at a time under a lock;
    `prepare`, `parse` and `encode` run on any thread without it.

    ``model``: the loaded parts; ``options``: the engine options (the state-cache budget, the step budget,
    chunking, snapshots, images, confidence, calibration: the fields that concern loading have been used);
    ``calibration``: an already loaded calibration (default: ``options.calibration``'s file, if any).
    """

    def __init__(
        self,
        model: LoadedModel,
        options: EngineOptions | None = None,
        *,
        calibration: Calibration | None = None,
    ) -> None:
        options = options or EngineOptions()
        self.model = model
        self.options = options
        """The options this engine was loaded with."""
        backbone = model.backbone
        self.encoder = Encoder(tokenizer_for_encoding(model.tokenizer), max_length=options.max_length)
        self.image_settings = ImageSettings(
            mode=options.image_mode,
            max_tokens=options.image_max_tokens,
            processor_config=load_processor_config(model.resolved.path),
        )
        self.preparer = RequestPreparer(self.encoder, self.image_settings)
        cache_bytes = (
            default_cache_bytes(backbone.device) if options.cache_mb is None else int(options.cache_mb * MiB)
        )
        self.state_cache = StateCache(cache_bytes)
        if calibration is None and options.calibration:
            calibration = Calibration.load(options.calibration)
        self.calibration = calibration
        """Temperatures applied to every question's probabilities before its answer is built (None: off);
        a tuned head with its own calibration uses that one instead."""
        resolved = model.resolved
        self.heads = HeadSet.load(
            parse_head_specs(options.head),
            model_name=resolved.name,
            release_dir=resolved.path,
            release_head=model.head,
            release_digest=model.head_digest,
            calibration=calibration,
            device=backbone.device,
        )
        """The default head and the named tuned heads (``--head``, `load_head`)."""
        self.card = EngineCard(
            model=model_card(resolved.name, untrained=resolved.is_tiny),
            options=options,
            device=str(backbone.device),
            weight_mode=backbone.weight_mode,
            compute_dtype=backbone.dtype_name,
            step_tokens=options.max_step_tokens or default_step_tokens(backbone.device),
            calibration=calibration.describe() if calibration is not None else None,
        )
        """What this engine is: its model's card, options, device, weights (``fp32``, ``bf16-storage``,
        ``int8``, ...), compute dtype (the head always computes in fp32), step budget and calibration."""
        self.last_timings = DecisionTimings()
        self._model_lock = threading.Lock()
        # Synchronous calls run one at a time (the server's loop still interleaves with them step by step):
        # a state two callers ask about at once is then computed once, as in one loop.
        self._sync_lock = threading.Lock()
        self.executor = StepExecutor(
            name=self.name,
            backbone=backbone,
            heads=self.heads,
            lexical=model.lexical,
            embedder=ImageEmbedder(model.vision_tower),
            state_cache=self.state_cache,
            prefix_ids=self.encoder.prefix_ids,
            model_lock=self._model_lock,
            options=options,
            tokenizer=self.encoder.tokenizer,
        )

    # ------------------------------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        model: str = "tiny",
        options: EngineOptions | None = None,
        *,
        checked_files: EngineFiles | None = None,
        **overrides: Any,
    ) -> Clef:
        """Load ``model``: ``"tiny"``, a local release directory, or a Hugging Face repo id with an optional
        ``@revision``. Nothing from the checkpoint is executed; weights come from safetensors only.

        ``options``: an `EngineOptions` (default: all defaults); ``overrides``: any of its fields by name
        (``Clef.load("tiny", cache_mb=0, weights="fp32")``), applied on top. See `EngineOptions` for what
        each does; the same options are the CLI flags and ``CLEF_*`` variables of ``clef decide / serve``.

        Raises ``CheckpointError`` (a missing or malformed file, named), ``InsufficientMemoryError`` (the
        model does not fit; the message says what would), `OptionsError` (a ValueError) for a bad option
        or calibration file (``CalibrationError``, checked before anything loads),
        TypeError for an unknown one, or ``ModelResolutionError`` when a download fails.

        ``checked_files``: what `check_engine_files` read for these options (``clef serve`` checks them
        before it listens), so the calibration file and the head directories are not read again here.
        """
        started = time.perf_counter()
        opts = (options or EngineOptions()).replace(**overrides) if overrides else options or EngineOptions()
        ImageSettings(mode=opts.image_mode, max_tokens=opts.image_max_tokens)  # validate before the slow part
        # A wrong --calibration or --head fails before the slow part.
        files = checked_files if checked_files is not None else check_engine_files(opts)
        if not files.belongs_to(opts):
            raise ValueError("checked_files were read for other --calibration / --head values")
        calibration, head_specs = files.calibration, list(files.heads)
        resolved = resolve_model(model)
        check_head_names(head_specs, resolved.name)  # and one named as the model
        if resolved.is_tiny:
            logger.warning("model %r is untrained (random weights): its answers are meaningless", model)
        # tokenizer.json is parsed once, by the tokenizer, and before the weights: a damaged one fails fast.
        info = verify_checkpoint(resolved.path, expected_sizes=resolved.expected_sizes, parse_tokenizer=False)
        tokenizer = _checkpoint_tokenizer(resolved.path)
        backbone = Backbone.load(
            resolved.path,
            device=opts.device,
            dtype=opts.dtype,
            info=info,
            check_memory=opts.check_memory,
            weights=opts.weights,
            int8_layers=opts.int8_layers,
            fused_kernels=opts.fused_kernels,
        )
        loaded = LoadedModel(
            resolved=resolved,
            tokenizer=tokenizer,
            backbone=backbone,
            head=JointSchemaHead.from_files(resolved.path, device=backbone.device),
            # On an accelerator the table lives there too: a request's option rows are gathered on the device.
            lexical=LexicalTable.from_safetensors(
                resolved.path, device=None if backbone.device.type == "cpu" else backbone.device
            ),
            vision_tower=VisionTower(resolved.path, device=backbone.device, dtype=backbone.dtype),
        )
        clef = cls(loaded, opts, calibration=calibration)
        # Which weights each name answers with, in the log of every start: a restart that serves other
        # weights under a name shows here.
        logger.info(
            "heads: %s",
            ", ".join(
                f"{head.identity.label} ({'default, ' if head.default else ''}{head.source}: {head.path})"
                for head in clef.heads.served()
            ),
        )
        logger.info(
            "loaded %s from %s on %s in %.1f s (%s compute: %s; weights %s, state cache %.0f MiB, step "
            "budget %d tokens)",
            resolved.name,
            resolved.path,
            backbone.device,
            time.perf_counter() - started,
            backbone.dtype_name,
            backbone.dtype_reason,
            backbone.weight_mode,
            clef.state_cache.capacity_bytes / MiB,
            clef.step_tokens,
        )
        return clef

    # ----------------------------------------------------------------------------------------- the parts

    @property
    def resolved(self) -> ResolvedModel:
        return self.model.resolved

    @property
    def tokenizer(self) -> ClefTokenizer:
        return self.model.tokenizer

    @property
    def backbone(self) -> Backbone:
        return self.model.backbone

    @property
    def head(self) -> JointSchemaHead:
        """The default head: the release's, or the bare ``--head DIR`` that replaces it."""
        return self.heads.default.head

    @property
    def lexical(self) -> LexicalTable:
        return self.model.lexical

    @property
    def vision_tower(self) -> VisionTower:
        return self.model.vision_tower

    @property
    def path(self) -> Path:
        """The checkpoint directory."""
        return self.model.resolved.path

    @property
    def prefix_state(self) -> BackboneState:
        """The backbone state after the constant prompt prefix (where every cold row starts)."""
        return self.executor.prefix_state

    @property
    def backbone_tokens(self) -> int:
        """Tokens that went through the backbone since load (cached or shared state tokens and pads are not
        counted)."""
        return self.executor.snapshot_work().backbone_tokens

    def cache_stats(self) -> dict[str, int]:
        """State-cache counters: ``hits`` / ``partials`` / ``misses`` (one per request: its state found
        whole, in part, not found), ``shared`` (requests that waited for another request computing their
        state and then reused it), ``stores`` (snapshots stored), ``evictions`` (tree nodes), ``entries``
        (tree nodes), ``points`` (resumable positions), ``bytes``, ``capacity_bytes``, ``tokens_saved``
        (tokens not run thanks to a cached or shared state, the 36-token prompt prefix included),
        ``reused_tokens`` (image and state tokens taken from the cache, summed over requests)."""
        return self.state_cache.stats()

    def replica_status(self) -> None:
        """None: this engine computes in this process (no replicas)."""
        return None

    def prepare_compute_thread(self) -> None:
        """Start the calling thread's CPU thread team (with flush-to-zero) before it runs the model: call it
        on the thread that will run every step (the server's engine loop does). Without it the team is
        started by the first request, and a team another live thread started first slows both (see
        `clef_runtime.model.kernels.configure_cpu_threads`). No-op off CPU."""
        if self.backbone.device.type == "cpu":
            from clef_runtime.model.kernels import start_thread_pool

            start_thread_pool()

    def clear_cache(self) -> None:
        """Drop every cached state (the prompt prefix stays)."""
        self.state_cache.clear()

    def runner(self) -> StepExecutor:
        """The step runner an `EngineLoop` drives (the server's engine thread)."""
        return self.executor

    def step_settings(
        self, *, max_rows: int = DEFAULT_STEP_ROWS, deterministic: bool = False
    ) -> StepSettings:
        """The policy settings of this engine's steps: its step budget, ``max_rows`` rows per step."""
        return build_step_settings(self.step_tokens, max_rows=max_rows, deterministic=deterministic)

    # ------------------------------------------------------------------------------------------ requests

    def parse(self, request: Any) -> SystemOneRequest:
        """Validate a request body (its images' wire format too) and return it without its images (they
        are not part of ``SystemOneRequest``; use `prepare` to keep them). Raises ``RequestValidationError``.
        """
        return parse_with_images(request)[0]

    def prepare(self, request: Any, *, max_length: int | None = None) -> Prepared:
        """Everything before the model, for one request body (a JSON-decoded dict, possibly with images in
        ``images`` or in the ``state`` array) or an already parsed ``SystemOneRequest`` (text only): take
        the images out, validate, decode and preprocess the images in the configured mode, encode the row
        token-exactly, compute the state-cache key. No model lock; the vision tower is not touched.

        Returns a `PreparedRequest`, or an `IndependentRequest` (one per question) for an ``x_independent``
        request with several questions. Raises ``RequestValidationError`` (bad body, bad image: the error
        names the image) or ``InputTooLongError`` (the schema with its images does not fit ``max_length``).
        """
        return self.preparer.prepare(request, max_length=max_length, resolve_head=self._resolve_head)

    def _resolve_head(self, request: SystemOneRequest) -> ServedHead:
        return self.heads.resolve(request.model, request.x_head_digest)

    # -------------------------------------------------------------------------------------------- heads

    def head_infos(self) -> tuple[HeadInfo, ...]:
        """Every served head's card (``GET /v1/heads``), the default head first."""
        return self.heads.infos()

    def load_head(self, name: str, path: str | Path) -> HeadInfo:
        """Load the head in directory ``path`` and serve it as ``name`` from the next prepared request on
        (``POST /v1/heads``). Reading and moving its weights runs on the calling thread without the model
        lock: requests being computed go on meanwhile. Raises `HeadRefusedError` naming the field at fault:
        ``name`` malformed or the model's own, ``path`` not a head directory for this backbone, or (a
        conflict) ``name`` already served."""
        if not HEAD_NAME.fullmatch(name):
            raise HeadRefusedError(
                "name",
                "a head name is 1-64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit; "
                f"got {name[:80]!r}",
            )
        if name == self.name:
            raise HeadRefusedError(
                "name",
                f"{name!r} is the model's own name (it picks the release head); give the head another name",
            )
        self.heads.check_free(name)
        directory = Path(path).expanduser()
        try:
            served = load_head(
                name,
                directory.resolve(),
                hidden_size=self.heads.default.head.hidden_size,
                calibration=self.calibration,
                device=self.backbone.device,
                source="api",
            )
        except (HeadLoadError, CalibrationError) as exc:
            raise HeadRefusedError("path", str(exc)) from None
        self.heads.add(served)
        logger.info("head loaded: %s from %s", served.identity.label, served.path)
        return served.info()

    def unload_head(self, name: str) -> HeadInfo:
        """Stop serving the named head ``name`` (``DELETE /v1/heads/{name}``): requests already prepared with
        it finish on it; later ones naming it are refused (`HeadNotLoadedError`). Raises
        `HeadNotLoadedError` for a name not served, `HeadRefusedError` for the default head."""
        served = self.heads.remove(name)
        logger.info("head unloaded: %s", served.identity.label)
        return served.info()

    def encode(self, request: Any, *, max_length: int | None = None) -> EncodedRecord:
        """Encode a request token-exactly as the reference (image blocks included: images are decoded and
        preprocessed to know their token counts); returns the ``EncodedRecord``. Raises
        ``RequestValidationError`` or ``InputTooLongError``."""
        prepared = self.prepare(request, max_length=max_length)
        if isinstance(prepared, IndependentRequest):
            raise ValueError("an x_independent request is several rows: encode its questions one by one")
        return prepared.record

    def decide(self, request: Any, *, explain: ExplainArgument = None) -> dict[str, Any]:
        """Answer one request (text and images); returns the System One response dict. ``explain`` (True,
        an ``x_explain`` object such as ``{"top_k": 3}``, or `ExplainOptions`) sets the request's
        ``x_explain``: each answer then carries its ``x_evidence``. Raises ``RequestValidationError`` /
        ``InputTooLongError`` for bad input (a bad ``explain`` names ``x_explain.top_k`` and so on)."""
        return self.decide_encoded([self.prepare(with_explain(request, explain))])[0].body()

    def decide_many(self, items: Sequence[Any], *, explain: ExplainArgument = None) -> list[dict[str, Any]]:
        """Answer several requests together: request bodies or `decide_encoded` items; one System One
        response per item, in order. ``explain`` sets every request body's ``x_explain`` as in `decide`
        (items already prepared keep what they were prepared with). Raises like `decide` and
        `decide_encoded`."""
        work = [
            item
            if isinstance(item, PreparedRequest | IndependentRequest | tuple)
            else self.prepare(with_explain(item, explain))
            for item in items
        ]
        return [decision.body() for decision in self.decide_encoded(work)]

    def decide_encoded(self, items: Sequence[DecisionItem]) -> list[Decision]:
        """Answer several prepared requests on the calling thread, in engine steps (what the server's loop
        runs, without its thread); one `Decision` per item, in order.

        An item is what `prepare` returns (the only form that can carry images; an `IndependentRequest` runs
        as one row per question, sharing the state's prefill, and its decisions merge into one), or a tuple
        ``(request, record)`` with ``record`` an ``EncodedRecord`` of a text-only request or a
        `PreparedRequest` (then ``request`` is ignored in favour of its own). Raises ValueError for a
        record with image blocks but no images; when a request fails, the first failure is raised after
        the others were answered.
        """
        return [future.result() for future in self._run_together(items)]

    def decide_settled(self, items: Sequence[DecisionItem]) -> list[Decision | Exception]:
        """`decide_encoded`, except that a request that fails does not fail the others: one `Decision` or
        the exception of that request per item, in order (bulk work records each row's own outcome)."""
        outcomes: list[Decision | Exception] = []
        for future in self._run_together(items):
            failure = future.exception()
            if failure is None:
                outcomes.append(future.result())
            elif isinstance(failure, Exception):
                outcomes.append(failure)
            else:  # KeyboardInterrupt, SystemExit: not a request's own failure
                raise failure
        return outcomes

    def _run_together(self, items: Sequence[DecisionItem]) -> list[Future[Decision]]:
        """Run every item in engine steps on the calling thread until all are done; their futures, in order
        (each holds its decision or its failure)."""
        work = [self._as_prepared(item) for item in items]
        if not work:
            return []
        with self._sync_lock:
            before = self.executor.snapshot_work()
            started = time.perf_counter()
            rows = sum(len(w.parts) if isinstance(w, IndependentRequest) else 1 for w in work)
            loop = EngineLoop(self.executor, self.step_settings(max_rows=rows), max_queue=rows)
            futures = [
                submit_parts(w, loop.submit) if isinstance(w, IndependentRequest) else loop.submit(w)
                for w in work
            ]
            loop.run_until_idle()
            decisions = [future.result() for future in futures if future.exception() is None]
            self._account(before, decisions, time.perf_counter() - started)
        return futures

    def probabilities_encoded(self, items: Sequence[DecisionItem]) -> list[list[list[float]]]:
        """Unrounded probabilities, per item, per question, per option in model order (what
        `decide_encoded` rounds into responses: calibrated when the engine has a calibration). Same items and
        errors as `decide_encoded`."""
        return [decision.probabilities or [] for decision in self.decide_encoded(items)]

    def hidden_rows(self, items: Sequence[DecisionItem]) -> list[Tensor]:
        """The backbone's final-norm rows of every item's whole row, fp32 CPU [T_i, hidden] each, computed
        exactly as `decide_encoded` does (state cache included). Same items and errors as
        `decide_encoded`."""
        work = [self._as_prepared(item) for item in items]
        if any(isinstance(w, IndependentRequest) for w in work):
            raise ValueError("hidden_rows: an x_independent request is several rows; pass its parts")
        with self.executor.collecting_hidden() as rows:
            self.decide_encoded(work)
        return [rows[id(w)].to(device="cpu", dtype=torch.float32) for w in work]

    def warmup(self, *, max_rows: int = DEFAULT_STEP_ROWS) -> None:
        """Run one small request so the first real request does not pay for lazy initialisation; on CUDA
        also every batch shape a step can form within the step budget and ``max_rows`` rows, so Triton
        autotuning happens now (see `clef_runtime.engine.warmup`)."""
        from clef_runtime.engine.warmup import run_backbone_warmup, warmup_shapes

        shapes = warmup_shapes(self.backbone.device.type, max_step_tokens=self.step_tokens, max_rows=max_rows)
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

    def _as_prepared(self, item: Any) -> Prepared:
        if isinstance(item, PreparedRequest | IndependentRequest):
            return item
        if isinstance(item, tuple) and len(item) == 2:
            request, record = item
            if isinstance(record, PreparedRequest):
                return record
            if isinstance(record, EncodedRecord):
                # PreparedRequest checks that a record with image blocks does not come without its images.
                # The head is resolved here, as `prepare` resolves it: an unloaded name is refused, never
                # answered by the default head.
                return PreparedRequest(request=request, record=record, head=self._resolve_head(request))
        raise TypeError(
            f"decide_encoded items are PreparedRequest or (request, EncodedRecord) tuples, got {type(item)}"
        )

    def _account(self, before: Any, decisions: Sequence[Decision], seconds: float) -> None:
        after = self.executor.snapshot_work()
        statuses = [decision.cache.status for decision in decisions]
        self.last_timings = DecisionTimings(
            backbone_s=after.backbone_s - before.backbone_s,
            head_s=after.head_s - before.head_s,
            answer_s=max(
                0.0, seconds - (after.backbone_s - before.backbone_s) - (after.head_s - before.head_s)
            ),
            vision_s=after.vision_s - before.vision_s,
            batch_size=len(decisions),
            backbone_tokens=sum(decision.timings.backbone_tokens for decision in decisions),
            cached_tokens=sum(
                decision.input_tokens - decision.timings.backbone_tokens for decision in decisions
            ),
            state_hits=statuses.count("hit"),
            state_partials=statuses.count("partial"),
            state_misses=statuses.count("miss"),
            steps=max((decision.timings.steps for decision in decisions), default=0),
        )
