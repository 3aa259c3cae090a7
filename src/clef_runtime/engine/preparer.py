"""Everything before the model, for one request: validate, take the images out, decode and preprocess them,
encode the row token-exactly, compute the state-cache key.

`RequestPreparer` needs only the checkpoint's tokenizer and processor config, not the weights: the engine
uses it on any thread (no model lock), and a scale-out ingress uses it alone to find the replica that holds
a request's state (`RequestPreparer.from_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clef_runtime.encoding.encoder import EncodedRecord, Encoder
from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
from clef_runtime.encoding.growth import stable_length
from clef_runtime.encoding.render import render
from clef_runtime.encoding.tokenizer import ClefTokenizer
from clef_runtime.engine.heads import ServedHead
from clef_runtime.engine.images import (
    ImageSettings,
    PreparedImage,
    check_images,
    load_processor_config,
    prepare_images,
)
from clef_runtime.engine.independent import IndependentRequest, RecordTokens
from clef_runtime.engine.state_cache import root_key, state_key
from clef_runtime.options import EngineOptions
from clef_runtime.protocol.images import parse_with_images
from clef_runtime.protocol.systemone import SystemOneRequest, independent_parts

__all__ = ["PreparedRequest", "RequestPreparer"]


@dataclass(frozen=True, eq=False)
class PreparedRequest(RecordTokens):
    """A request ready for `Clef.decide_encoded`: the parsed request (images taken out), its encoded row,
    its images preprocessed for the vision tower (in block order) and its state-cache key.

    Build it with `Clef.prepare` (or `RequestPreparer.prepare`). ``input_tokens`` /
    ``truncated_state_tokens`` mirror the record's, so it can stand where an ``EncodedRecord`` is expected
    for accounting.
    """

    request: SystemOneRequest
    record: EncodedRecord
    images: tuple[PreparedImage, ...] = ()
    state_key: bytes = field(default=b"", repr=False)
    tail_at: int | None = None
    """Where the state's unstable tail starts in ``record.input_ids`` (see `clef_runtime.encoding.growth`;
    None: unknown): the state cache keeps a snapshot there so an extension of the state resumes near its
    end."""
    head: ServedHead | None = field(default=None, repr=False, compare=False)
    """The head that answers it, resolved when it was prepared (`HeadSet.resolve`), so that unloading the
    head later does not change who answers a request already admitted; None: resolved when it is computed
    (a scale-out ingress prepares without heads; its replicas' heads are fixed)."""
    root_key: bytes = field(default=b"", repr=False, init=False)

    def __post_init__(self) -> None:
        check_images(self.record, self.images)
        digests = [i.digest for i in self.images]
        if not self.state_key:
            key = state_key(self.record.input_ids[: self.record.state_end], digests)
            object.__setattr__(self, "state_key", key)
        object.__setattr__(
            self, "root_key", root_key(self.record.input_ids[: self.record.state_start], digests)
        )


class RequestPreparer:
    """Prepares requests with one encoder and one image configuration. Thread-safe."""

    def __init__(self, encoder: Encoder, image_settings: ImageSettings) -> None:
        self.encoder = encoder
        self.image_settings = image_settings

    @classmethod
    def from_checkpoint(cls, path: str | Path, options: EngineOptions) -> RequestPreparer:
        """A preparer for the release directory ``path`` (its tokenizer and processor config only).
        Raises TokenizerLoadError / ValueError for unusable files."""
        tokenizer = ClefTokenizer.load(path)
        encoder = Encoder(tokenizer_for_encoding(tokenizer), max_length=options.max_length)
        settings = ImageSettings(
            mode=options.image_mode,
            max_tokens=options.image_max_tokens,
            processor_config=load_processor_config(path),
        )
        return cls(encoder, settings)

    def prepare(
        self,
        request: Any,
        *,
        max_length: int | None = None,
        resolve_head: Callable[[SystemOneRequest], ServedHead | None] | None = None,
    ) -> PreparedRequest | IndependentRequest[PreparedRequest]:
        """One request body (a JSON-decoded dict, possibly with images in ``images`` or in the ``state``
        array) or an already parsed ``SystemOneRequest`` (text only) -> `PreparedRequest`.

        An ``x_independent`` request with several questions becomes an `IndependentRequest`: one
        `PreparedRequest` per question (its images decoded once). Raises ``RequestValidationError`` (bad
        body, bad image: the error names the image) or ``InputTooLongError`` (the schema with its images
        does not fit ``max_length``). ``resolve_head``: the request's head, attached to every part (it
        raises ``HeadError`` before any image is decoded).
        """
        parsed, sources = parse_with_images(request)
        head = resolve_head(parsed) if resolve_head is not None else None
        images = prepare_images(sources, self.image_settings) if sources else ()
        parts = [self._prepare_one(part, images, max_length, head) for part in independent_parts(parsed)]
        return parts[0] if len(parts) == 1 else IndependentRequest(parsed, tuple(parts))

    def _prepare_one(
        self,
        parsed: SystemOneRequest,
        images: tuple[PreparedImage, ...],
        max_length: int | None,
        head: ServedHead | None,
    ) -> PreparedRequest:
        record = self.encoder.encode(
            parsed, image_token_counts=[image.n_tokens for image in images], max_length=max_length
        )
        return PreparedRequest(
            request=parsed, record=record, images=images, tail_at=self._tail_at(parsed, record), head=head
        )

    def _tail_at(self, parsed: SystemOneRequest, record: EncodedRecord) -> int | None:
        """Where the state's unstable tail starts in the row (None when the state was truncated: its kept
        head is what an extension shares)."""
        if record.truncated_state_tokens:
            return None
        kept = stable_length(
            render(parsed.state),
            record.input_ids[record.state_start : record.state_end],
            self.encoder.tokenizer.encode,
        )
        return None if kept is None else record.state_start + kept
