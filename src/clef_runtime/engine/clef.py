"""``Clef``: the facade users and the server talk to. Load a model, encode requests, answer them.

One batched decision = encode (cheap, cached) -> backbone prefill over the right-padded batch (final-norm
hidden
rows of every position) -> lexical rows of the option spans -> the joint schema head in fp32 -> per-question
softmax -> System One responses.
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

from clef_runtime.encoding.encoder import DEFAULT_MAX_LENGTH, EncodedRecord, Encoder
from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
from clef_runtime.encoding.tokenizer import ClefTokenizer
from clef_runtime.engine.answers import build_response
from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import verify_checkpoint
from clef_runtime.model.head import HeadLayout, JointSchemaHead, probabilities
from clef_runtime.model.lexical import LexicalTable
from clef_runtime.model.resolve import ResolvedModel, resolve_model
from clef_runtime.protocol.systemone import SystemOneRequest, parse_request

__all__ = ["Clef", "DecisionTimings"]

logger = logging.getLogger("clef_runtime.engine")

CLEF_FLASH_RELEASE_DATE = "2026-10-01"
TINY_DESCRIPTION = (
    "tiny: an UNTRAINED Clef checkpoint with random weights in the release layout, for tests and demos; "
    "its answers are meaningless"
)


@dataclass
class DecisionTimings:
    """Where the time of the last batch went (seconds) and how much work the backbone did."""

    backbone_s: float = 0.0
    head_s: float = 0.0
    answer_s: float = 0.0
    batch_size: int = 0
    backbone_tokens: int = 0


@dataclass
class _Counters:
    backbone_tokens: int = 0
    batches: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _layout(record: EncodedRecord) -> HeadLayout:
    return HeadLayout(
        type_ids=[q.type_id for q in record.questions],
        question_spans=[q.question_span for q in record.questions],
        option_spans=[list(q.option_spans) for q in record.questions],
    )


class Clef:
    """A loaded Clef model. Thread-safe: the model runs one batch at a time under a lock."""

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
        self.untrained = resolved.is_tiny
        self.name = resolved.name
        self.description = (
            TINY_DESCRIPTION if self.untrained else f"{resolved.name}: Cloudflare's Clef decision model"
        )
        self.release_date = "2026-11-29" if self.untrained else CLEF_FLASH_RELEASE_DATE
        self.last_timings = DecisionTimings()
        self._counters = _Counters()
        self._model_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        model: str = "tiny",
        *,
        device: str = "auto",
        prefill_chunk: int | None = None,
        pad_last_chunk: bool = False,
        max_length: int = DEFAULT_MAX_LENGTH,
        check_memory: bool = True,
    ) -> Clef:
        """Load ``model``: ``"tiny"``, a local release directory, or a Hugging Face repo id with an optional
        ``@revision``. Nothing from the checkpoint is executed; weights come from safetensors only.

        Raises ``CheckpointError`` (a missing or malformed file, named), ``InsufficientMemoryError`` (the
        model
        does not fit; the message says what would), or huggingface_hub errors when a download fails.
        """
        started = time.perf_counter()
        resolved = resolve_model(model)
        if resolved.is_tiny:
            logger.warning("model %r is UNTRAINED (random weights): its answers are meaningless", model)
        info = verify_checkpoint(resolved.path, expected_sizes=resolved.expected_sizes)
        backbone = Backbone.load(resolved.path, device=device, info=info, check_memory=check_memory)
        tokenizer = ClefTokenizer.load(resolved.path)
        head = JointSchemaHead.from_files(resolved.path, device=backbone.device)
        lexical = LexicalTable.from_safetensors(resolved.path)
        clef = cls(
            resolved=resolved,
            tokenizer=tokenizer,
            backbone=backbone,
            head=head,
            lexical=lexical,
            max_length=max_length,
            prefill_chunk=prefill_chunk,
            pad_last_chunk=pad_last_chunk,
        )
        logger.info(
            "loaded %s from %s on %s in %.1f s",
            resolved.name,
            resolved.path,
            backbone.device,
            time.perf_counter() - started,
        )
        return clef

    @property
    def path(self) -> Path:
        """The checkpoint directory."""
        return self.resolved.path

    @property
    def backbone_tokens(self) -> int:
        """Tokens that went through the backbone since load (a cache hit does not add its cached tokens)."""
        return self._counters.backbone_tokens

    # ------------------------------------------------------------------------------------------ requests

    def parse(self, request: Any) -> SystemOneRequest:
        """Validate a request body; raises ``RequestValidationError``."""
        return parse_request(request)

    def encode(self, request: Any, *, max_length: int | None = None) -> EncodedRecord:
        """Encode a request token-exactly as the reference; raises ``RequestValidationError`` or
        ``InputTooLongError``."""
        return self.encoder.encode(request, max_length=max_length)

    def decide(self, request: Any) -> dict[str, Any]:
        """Answer one request; returns the System One response dict. Raises ``RequestValidationError`` /
        ``InputTooLongError`` for bad input."""
        parsed = self.parse(request)
        record = self.encode(parsed)
        return self.decide_encoded([(parsed, record)])[0]

    def decide_encoded(self, items: Sequence[tuple[SystemOneRequest, EncodedRecord]]) -> list[dict[str, Any]]:
        """Answer several encoded requests in one batched backbone pass; one response per item, in order."""
        if not items:
            return []
        records = [record for _, record in items]
        with self._model_lock, torch.inference_mode():
            t0 = time.perf_counter()
            if self.pad_last_chunk:
                # The seed's padded chunk form runs one record at a time.
                hiddens = [
                    self.backbone.hidden_states(
                        r.input_ids, prefill_chunk=self.prefill_chunk, pad_last_chunk=True
                    )
                    for r in records
                ]
            else:
                hiddens = self.backbone.hidden_states_batch(
                    [r.input_ids for r in records], prefill_chunk=self.prefill_chunk
                )
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
            t2 = time.perf_counter()
        responses = [
            build_response(request, record, p, self.name)
            for (request, record), p in zip(items, probs, strict=True)
        ]
        t3 = time.perf_counter()
        tokens = sum(r.input_tokens for r in records)
        with self._counters.lock:
            self._counters.backbone_tokens += tokens
            self._counters.batches += 1
            self._counters.requests += len(items)
        self.last_timings = DecisionTimings(
            backbone_s=t1 - t0,
            head_s=t2 - t1,
            answer_s=t3 - t2,
            batch_size=len(items),
            backbone_tokens=tokens,
        )
        return responses

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
