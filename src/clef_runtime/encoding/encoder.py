"""The Clef prompt encoder: a System One request -> token ids + question/option spans.

This reproduces the author's ``encode_record`` (Cloudflare/clef-flash ``joint_schema_model.py`` at the pinned
revision, described in the seed's ``decision.prompt``): every piece is tokenized on its own without added
special tokens (special-token text inside user content is still parsed as a special token, as the reference
does), then the pieces are concatenated as

    prefix + [image block] + state + schema + suffix

Spans are ``[start, end)`` over the final ids: a question span covers ``render(instructions or id)``, an
option span covers ``render({"option_id": ..., "description": ...})``. When the row is longer than
``max_length`` the state loses its tail; when the schema alone does not fit, the request is refused.

Because pieces are tokenized independently, their ids can be cached exactly: :class:`Encoder` keeps a
bounded cache so a state asked about many times, and the fixed schema scaffolding, are tokenized once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from clef_runtime.encoding.render import render
from clef_runtime.encoding.special_tokens import ENDOFTEXT_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from clef_runtime.options import DEFAULT_MAX_LENGTH
from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.protocol.systemone import (
    ChoiceQuestion,
    NoulQuestion,
    ScoreQuestion,
    SystemOneRequest,
    parse_request,
)

__all__ = [
    "DEFAULT_MAX_LENGTH",
    "ENDOFTEXT_ID",
    "IMAGE_PAD_ID",
    "NOUL_DEFAULT_CRITERIA",
    "PREFIX_TEXT",
    "QUESTION_TYPE_IDS",
    "SUFFIX_TEXT",
    "SYSTEM_PROMPT",
    "VISION_END_ID",
    "VISION_START_ID",
    "EncodedQuestion",
    "EncodedRecord",
    "Encoder",
    "TextTokenizer",
    "question_options",
]

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)
PREFIX_TEXT = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEADER_TEXT = "\n\nSCHEMA FIELDS:\n"
ALLOWED_OPTIONS_TEXT = "\nALLOWED OPTIONS:\n"
OPTION_END_TEXT = "\n"
FIELD_END_TEXT = "END FIELD\n"
SUFFIX_TEXT = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"

#: Question type ids of the release: the rows of the head's ``type_embedding``.
QUESTION_TYPE_IDS: dict[str, int] = {"noul": 0, "choice": 1, "score": 2}
NOUL_DEFAULT_CRITERIA: dict[str, str] = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}

NEWLINE_TEXT = "\n"

# Bounds of the piece cache: enough for many large states without letting one client grow it unbounded.
_DEFAULT_CACHE_CHARS = 64 * 1024 * 1024
_MAX_CACHED_PIECE_CHARS = 4 * 1024 * 1024


class TextTokenizer(Protocol):
    """What the encoder needs from a tokenizer (``clef_runtime.encoding.tokenizer.ClefTokenizer``)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]: ...


@dataclass(frozen=True, slots=True)
class EncodedQuestion:
    """One question of an encoded record, options in the order the model sees them."""

    question_id: str
    question_type: str
    type_id: int
    question_span: tuple[int, int]
    option_spans: tuple[tuple[int, int], ...]
    option_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The ``clef encode`` form of this question (``question_type`` is the head's type id 0/1/2)."""
        return {
            "question_id": self.question_id,
            "question_type": self.type_id,
            "question_span": list(self.question_span),
            "option_spans": [list(s) for s in self.option_spans],
            "option_ids": list(self.option_ids),
        }


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """A request as the model reads it. Immutable.

    ``state_end`` is the index where the schema starts: ``input_ids[:state_end]`` (prefix, images, state) is
    what a later request must share exactly to reuse the backbone work. ``image_blocks`` lists, per image,
    ``(first_pad_index, n_pad_tokens)``.
    """

    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    truncated_state_tokens: int
    state_start: int
    state_end: int
    image_blocks: tuple[tuple[int, int], ...] = ()

    @property
    def input_tokens(self) -> int:
        """The number of tokens the backbone reads (``usage.input_tokens``)."""
        return len(self.input_ids)

    @property
    def num_options(self) -> int:
        """Options over all questions."""
        return sum(len(q.option_ids) for q in self.questions)

    def to_json(self) -> dict[str, Any]:
        """The ``clef encode`` output object."""
        return {
            "input_ids": list(self.input_ids),
            "questions": [q.to_json() for q in self.questions],
            "truncated_state_tokens": self.truncated_state_tokens,
        }


def question_options(question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> list[tuple[str, Any]]:
    """The (option_id, description) pairs of a question in the order the model sees them.

    noul: ``true``, ``false`` with the default texts, overridden side by side by ``criteria`` (explicit null
    side has no description); choice: option ids sorted as Python strings (code-point order); score: levels
    ``"0".."n-1"``.
    """
    if isinstance(question, NoulQuestion):
        criteria: dict[str, Any] = dict(NOUL_DEFAULT_CRITERIA)
        for side, description in (question.criteria or {}).items():
            criteria[side] = description
        return [("true", criteria["true"]), ("false", criteria["false"])]
    if isinstance(question, ChoiceQuestion):
        return sorted((str(k), v) for k, v in question.criteria.items())
    return [(str(i), v) for i, v in enumerate(question.criteria)]


def _option_semantics(option_id: str, description: Any) -> dict[str, Any]:
    semantics: dict[str, Any] = {"option_id": option_id}
    if description is not None:
        semantics["description"] = description
    return semantics


def _render_at(value: Any, loc: tuple[str | int, ...]) -> str:
    try:
        return render(value)
    except (TypeError, ValueError) as exc:
        raise RequestValidationError.single(loc, f"cannot be rendered as JSON: {exc}", "json_type") from None


class _PieceCache:
    """A thread-safe LRU of text piece -> token ids, bounded by the total characters it holds."""

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._chars = 0
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def lookup(self, texts: Iterable[str]) -> tuple[list[tuple[int, ...] | None], int]:
        found: list[tuple[int, ...] | None] = []
        missing = 0
        with self._lock:
            for text in texts:
                ids = self._entries.get(text)
                if ids is None:
                    missing += 1
                else:
                    self._entries.move_to_end(text)
                found.append(ids)
            self.hits += len(found) - missing
            self.misses += missing
        return found, missing

    def store(self, items: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        with self._lock:
            for text, ids in items:
                if len(text) > _MAX_CACHED_PIECE_CHARS or text in self._entries:
                    continue
                self._entries[text] = ids
                self._chars += len(text)
            while self._chars > self._max_chars and self._entries:
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old)


class Encoder:
    """Encodes requests for one tokenizer, caching the ids of pieces it has seen (exact: pieces are tokenized
    independently by construction). Thread-safe.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        max_length: int = DEFAULT_MAX_LENGTH,
        cache_chars: int = _DEFAULT_CACHE_CHARS,
    ) -> None:
        if max_length < 1:
            raise ValueError("max_length must be positive")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._cache = _PieceCache(cache_chars)
        self.prefix_ids = tuple(tokenizer.encode(PREFIX_TEXT))
        self.suffix_ids = tuple(tokenizer.encode(SUFFIX_TEXT))
        self.newline_ids = tuple(tokenizer.encode(NEWLINE_TEXT))

    @property
    def cache_stats(self) -> dict[str, int]:
        """Piece-cache hits and misses since start."""
        return {"hits": self._cache.hits, "misses": self._cache.misses}

    def tokenize_pieces(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """Token ids of each text, each tokenized on its own (through the cache)."""
        found, missing = self._cache.lookup(texts)
        if missing:
            todo = list(dict.fromkeys(t for t, ids in zip(texts, found, strict=True) if ids is None))
            fresh = {t: tuple(ids) for t, ids in zip(todo, self.tokenizer.encode_many(todo), strict=True)}
            self._cache.store(fresh.items())
            found = [ids if ids is not None else fresh[t] for t, ids in zip(texts, found, strict=True)]
        return found  # type: ignore[return-value]

    def encode(
        self,
        request: SystemOneRequest | dict[str, Any],
        *,
        image_token_counts: Sequence[int] = (),
        max_length: int | None = None,
    ) -> EncodedRecord:
        """Encode a request exactly as the reference ``encode_record`` does.

        ``image_token_counts`` gives, per image, its number of ``<|image_pad|>`` tokens (the merged grid H*W);
        the image block is placed right after the prefix. Returns an :class:`EncodedRecord`. Raises
        :class:`RequestValidationError` for an invalid request or a piece that renders to no token, and
        :class:`InputTooLongError` when the schema (with prefix, images, suffix) exceeds ``max_length``.
        """
        req = parse_request(request)
        limit = self.max_length if max_length is None else max_length

        # Collect every piece first, so they are tokenized in one call.
        pieces: list[str] = [_render_at(req.state, ("state",)), SCHEMA_HEADER_TEXT]
        # (piece index of the instructions, [(piece index of the option, option loc)], ...) per question
        plan: list[tuple[str, str, int, list[int], list[str], list[tuple[str | int, ...]]]] = []
        for number, (qid, question) in enumerate(req.questions.items(), start=1):
            instructions = question.instructions
            if instructions is None or instructions == "":
                instructions = qid
            pieces.append(f"\nFIELD {number}\nID: {qid}\nTYPE: {question.type}\nINSTRUCTION: ")
            instr_index = len(pieces)
            pieces.append(_render_at(instructions, ("questions", qid, "instructions")))
            pieces.append(ALLOWED_OPTIONS_TEXT)
            option_indexes: list[int] = []
            option_ids: list[str] = []
            option_locs: list[tuple[str | int, ...]] = []
            for j, (option_id, description) in enumerate(question_options(question), start=1):
                loc: tuple[str | int, ...] = (
                    ("questions", qid, "criteria", int(option_id))
                    if isinstance(question, ScoreQuestion)
                    else ("questions", qid, "criteria", option_id)
                )
                pieces.append(f"OPTION {j}: ")
                option_indexes.append(len(pieces))
                pieces.append(_render_at(_option_semantics(option_id, description), loc))
                pieces.append(OPTION_END_TEXT)
                option_ids.append(option_id)
                option_locs.append(loc)
            pieces.append(FIELD_END_TEXT)
            plan.append((qid, question.type, instr_index, option_indexes, option_ids, option_locs))

        ids = self.tokenize_pieces(pieces)
        state_ids = ids[0]

        # Offsets of every schema piece relative to the schema's start.
        offsets = [0] * len(pieces)
        schema_len = 0
        for k in range(1, len(pieces)):
            offsets[k] = schema_len
            schema_len += len(ids[k])

        media_ids: list[int] = []
        image_blocks: list[tuple[int, int]] = []
        for n_tokens in image_token_counts:
            if n_tokens < 1:
                raise ValueError("an image needs at least one token")
            image_blocks.append((len(self.prefix_ids) + len(media_ids) + 1, n_tokens))
            media_ids += [VISION_START_ID, *([IMAGE_PAD_ID] * n_tokens), VISION_END_ID]
        if image_token_counts:
            media_ids += self.newline_ids

        head_len = len(self.prefix_ids) + len(media_ids)
        fixed = head_len + schema_len + len(self.suffix_ids)
        if fixed > limit:
            raise InputTooLongError(
                ("questions",),
                f"the schema requires {fixed} tokens before the state; the maximum is {limit}",
                input_tokens=fixed,
                limit=limit,
            )
        kept = min(len(state_ids), limit - fixed)
        truncated = len(state_ids) - kept
        schema_start = head_len + kept

        questions: list[EncodedQuestion] = []
        for qid, qtype, instr_index, option_indexes, option_ids, option_locs in plan:
            if not ids[instr_index]:
                raise RequestValidationError.single(
                    ("questions", qid, "instructions"), "renders to no token", "empty_span"
                )
            q_start = schema_start + offsets[instr_index]
            spans = []
            for index, loc in zip(option_indexes, option_locs, strict=True):
                if not ids[index]:
                    raise RequestValidationError.single(loc, "option renders to no token", "empty_span")
                start = schema_start + offsets[index]
                spans.append((start, start + len(ids[index])))
            questions.append(
                EncodedQuestion(
                    question_id=qid,
                    question_type=qtype,
                    type_id=QUESTION_TYPE_IDS[qtype],
                    question_span=(q_start, q_start + len(ids[instr_index])),
                    option_spans=tuple(spans),
                    option_ids=tuple(option_ids),
                )
            )

        input_ids: list[int] = [*self.prefix_ids, *media_ids, *state_ids[:kept]]
        for piece_ids in ids[1:]:
            input_ids += piece_ids
        input_ids += self.suffix_ids
        return EncodedRecord(
            input_ids=tuple(input_ids),
            questions=tuple(questions),
            truncated_state_tokens=truncated,
            state_start=head_len,
            state_end=schema_start,
            image_blocks=tuple(image_blocks),
        )
