"""The encoder against an independent, literal re-implementation of the reference ``encode_record``."""

from __future__ import annotations

import json
import threading
import unicodedata
from collections.abc import Sequence
from typing import Any

import pytest

from clef_runtime.encoding.encoder import (
    IMAGE_PAD_ID,
    NOUL_DEFAULT_CRITERIA,
    VISION_END_ID,
    VISION_START_ID,
    EncodedRecord,
    Encoder,
    question_options,
)
from clef_runtime.encoding.render import render
from clef_runtime.encoding.tokenizer import ClefTokenizer
from clef_runtime.protocol.errors import InputTooLongError, RequestValidationError
from clef_runtime.protocol.systemone import parse_request

SYSTEM = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)


@pytest.fixture(scope="module")
def tok() -> ClefTokenizer:
    return ClefTokenizer.default()


# ---------------------------------------------------- an independent reference, written from the spec


def ref_render(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def ref_options(q: dict[str, Any]) -> list[tuple[str, Any]]:
    if q["type"] == "noul":
        crit = {
            "true": "The proposition is true or the answer is yes.",
            "false": "The proposition is false or the answer is no.",
        }
        crit.update(q.get("criteria") or {})
        return [("true", crit["true"]), ("false", crit["false"])]
    if q["type"] == "choice":
        return sorted((str(k), v) for k, v in q["criteria"].items())
    return [(str(i), v) for i, v in enumerate(q["criteria"])]


def ref_encode(request: dict[str, Any], tok: ClefTokenizer, max_length: int = 16384) -> dict[str, Any]:
    def enc(text: str) -> list[int]:
        return list(tok.encode(text))

    prefix = enc(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nSTATE:\n")
    state = enc(ref_render(request["state"]))
    schema: list[int] = enc("\n\nSCHEMA FIELDS:\n")
    questions = []
    for i, (qid, q) in enumerate(request["questions"].items(), start=1):
        schema += enc(f"\nFIELD {i}\nID: {qid}\nTYPE: {q['type']}\nINSTRUCTION: ")
        instructions = q.get("instructions")
        if instructions is None or instructions == "":
            instructions = qid
        start = len(schema)
        schema += enc(ref_render(instructions))
        q_span = (start, len(schema))
        schema += enc("\nALLOWED OPTIONS:\n")
        spans, ids = [], []
        for j, (oid, desc) in enumerate(ref_options(q), start=1):
            schema += enc(f"OPTION {j}: ")
            sem: dict[str, Any] = {"option_id": oid}
            if desc is not None:
                sem["description"] = desc
            start = len(schema)
            schema += enc(ref_render(sem))
            spans.append((start, len(schema)))
            schema += enc("\n")
            ids.append(oid)
        schema += enc("END FIELD\n")
        questions.append((qid, q["type"], q_span, spans, ids))
    suffix = enc("\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:")
    fixed = len(prefix) + len(schema) + len(suffix)
    if fixed > max_length:
        raise ValueError("schema too long")
    kept = state[: max_length - fixed]
    shift = len(prefix) + len(kept)
    return {
        "input_ids": prefix + kept + schema + suffix,
        "questions": [
            (qid, t, (qs + shift, qe + shift), [(s + shift, e + shift) for s, e in spans], ids)
            for qid, t, (qs, qe), spans, ids in questions
        ],
        "truncated": len(state) - len(kept),
    }


def as_tuple(record: EncodedRecord) -> dict[str, Any]:
    return {
        "input_ids": list(record.input_ids),
        "questions": [
            (q.question_id, q.question_type, q.question_span, list(q.option_spans), list(q.option_ids))
            for q in record.questions
        ],
        "truncated": record.truncated_state_tokens,
    }


EXAMPLE: dict[str, Any] = {
    "model": "jev-latest",
    "state": {"ticket": "Charged twice, please refund today.", "amount": 1250.0, "count": 1250},
    "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {
            "type": "choice",
            "instructions": "Which team?",
            "criteria": {"billing": "charges, refunds", "tech": None, "Sales": {"desc": ["a", 1]}},
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent?",
            "criteria": ["can wait", "this week", "today"],
        },
    },
}

CASES: list[dict[str, Any]] = [
    EXAMPLE,
    {"state": "plain text state", "questions": {"q": {"type": "noul"}}},
    {"state": "", "questions": {"q": {"type": "noul", "instructions": ""}}},
    {
        "state": ["a", {"b": None, "a": True}],
        "questions": {"q": {"type": "noul", "criteria": {"false": "nope"}}},
    },
    {
        "state": {"text": "日本語のテキスト 🙂👍🏽 👨‍👩‍👧 🇫🇷", "nested": {"z": [1, 2.5, -0.0, 1e-7, 10**20]}},
        "questions": {
            "多言語": {
                "type": "choice",
                "criteria": {"b": None, "B": "upper", "10": "ten", "9": "nine", "é": "e"},
            },
            "emoji 🙂": {
                "type": "score",
                "instructions": {"ask": "how much?"},
                "criteria": [{"x": 1}, ["y"], "z"],
            },
        },
    },
    {
        "state": "special <|im_end|> and <think> tokens inside <|image_pad|> text",
        "questions": {"q<|im_start|>": {"type": "noul", "instructions": ["<|endoftext|>", 3]}},
    },
    {
        "state": "decomposed e\u0301 and composed é, Devanagari नमस्ते, Thai สวัสดี, Korean 한국어",
        "questions": {"a": {"type": "noul", "criteria": {"true": None}}},
    },
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_independent_reference(tok: ClefTokenizer, case: int) -> None:
    request = CASES[case]
    assert as_tuple(Encoder(tok).encode(request)) == ref_encode(request, tok)


def test_prefix_and_suffix_lengths(tok: ClefTokenizer) -> None:
    encoder = Encoder(tok)
    assert len(encoder.prefix_ids) == 36
    assert len(encoder.suffix_ids) == 18
    assert encoder.suffix_ids[-1] == 25
    record = encoder.encode(CASES[1])
    assert record.input_ids[:36] == encoder.prefix_ids
    assert record.input_ids[-18:] == encoder.suffix_ids
    assert record.state_start == 36
    assert record.input_tokens == len(record.input_ids)


def test_spans_decode_to_their_rendered_text(tok: ClefTokenizer) -> None:
    for request in CASES:
        parsed = parse_request(request)
        record = Encoder(tok).encode(request)
        for enc in record.questions:
            question = parsed.questions[enc.question_id]
            instructions = (
                question.instructions if question.instructions not in (None, "") else enc.question_id
            )
            s, e = enc.question_span
            assert e > s
            assert tok.decode(record.input_ids[s:e]) == unicodedata.normalize("NFC", render(instructions))
            for (s, e), (oid, desc) in zip(enc.option_spans, question_options(question), strict=True):
                sem = {"option_id": oid} if desc is None else {"option_id": oid, "description": desc}
                assert e > s
                assert tok.decode(record.input_ids[s:e]) == unicodedata.normalize("NFC", render(sem))


def test_option_order(tok: ClefTokenizer) -> None:
    record = Encoder(tok).encode(CASES[4])
    choice, score = record.questions
    # Python string order = code points: digits < upper case < lower case < non-ASCII.
    assert choice.option_ids == ("10", "9", "B", "b", "é")
    assert score.option_ids == ("0", "1", "2")
    assert [q.type_id for q in record.questions] == [1, 2]
    noul = Encoder(tok).encode(CASES[1]).questions[0]
    assert noul.option_ids == ("true", "false")
    assert noul.type_id == 0


def test_noul_defaults_and_one_sided_override(tok: ClefTokenizer) -> None:
    def semantics(criteria: Any) -> list[tuple[str, Any]]:
        return question_options(
            parse_request(
                {"state": "", "questions": {"q": {"type": "noul", "criteria": criteria}}}
            ).questions["q"]
        )

    assert semantics(None) == [
        ("true", NOUL_DEFAULT_CRITERIA["true"]),
        ("false", NOUL_DEFAULT_CRITERIA["false"]),
    ]
    assert semantics({"false": "nope"}) == [("true", NOUL_DEFAULT_CRITERIA["true"]), ("false", "nope")]
    # An explicit null side is shown without a description, as the reference's dict.update does.
    assert semantics({"true": None}) == [("true", None), ("false", NOUL_DEFAULT_CRITERIA["false"])]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ('as is {"x": 1}', 'as is {"x": 1}'),
        ({"b": 1, "a": 2}, '{"a":2,"b":1}'),
        ({"n": 1250}, '{"n":1250}'),
        ({"n": 1250.0}, '{"n":1250.0}'),
        ([1e-7, 1e20, 0.1, -0.0], "[1e-07,1e+20,0.1,-0.0]"),
        ({"é": "ü", "日": ["本"]}, '{"é":"ü","日":["本"]}'),
        ([[1, [2, {"z": None, "y": True}]], {}], '[[1,[2,{"y":true,"z":null}]],{}]'),
        ({"Z": 1, "a": 2, "_": 3, "1": 4}, '{"1":4,"Z":1,"_":3,"a":2}'),
        (True, "true"),
        (None, "null"),
    ],
)
def test_render(value: Any, text: str) -> None:
    assert render(value) == text


def long_state_request(words: int = 300) -> dict[str, Any]:
    return {
        "state": " ".join(f"word{i}" for i in range(words)),
        "questions": {"q": {"type": "noul", "instructions": "ok?"}},
    }


def test_truncation_at_the_exact_boundary(tok: ClefTokenizer) -> None:
    request = long_state_request()
    full = Encoder(tok).encode(request)
    n = full.input_tokens
    at = Encoder(tok, max_length=n).encode(request)
    assert at.input_ids == full.input_ids
    assert at.truncated_state_tokens == 0
    above = Encoder(tok, max_length=n + 1).encode(request)
    assert above.input_ids == full.input_ids
    below = Encoder(tok, max_length=n - 1).encode(request)
    assert below.input_tokens == n - 1
    assert below.truncated_state_tokens == 1
    # The state keeps its beginning: everything up to the cut is identical, the schema follows.
    assert below.input_ids[: full.state_end - 1] == full.input_ids[: full.state_end - 1]
    assert below.input_ids[below.state_end :] == full.input_ids[full.state_end :]
    assert below.questions[0].question_span == tuple(x - 1 for x in full.questions[0].question_span)
    assert as_tuple(below) == ref_encode(request, tok, max_length=n - 1)


def test_schema_too_long_is_refused(tok: ClefTokenizer) -> None:
    request = long_state_request()
    full = Encoder(tok).encode(request)
    state_tokens = full.state_end - full.state_start
    fixed = full.input_tokens - state_tokens
    only_schema = Encoder(tok, max_length=fixed).encode(request)
    assert only_schema.truncated_state_tokens == state_tokens
    assert only_schema.state_end == only_schema.state_start
    with pytest.raises(InputTooLongError) as info:
        Encoder(tok, max_length=fixed - 1).encode(request)
    assert info.value.input_tokens == fixed
    assert info.value.limit == fixed - 1
    assert info.value.errors[0]["loc"] == ("questions",)


def test_max_length(tok: ClefTokenizer) -> None:
    request = long_state_request()
    encoder = Encoder(tok)
    assert encoder.encode(request).input_tokens > 200
    assert encoder.encode(request, max_length=200).input_tokens == 200


def test_image_blocks_follow_the_prefix(tok: ClefTokenizer) -> None:
    encoder = Encoder(tok)
    plain = encoder.encode(EXAMPLE)
    record = encoder.encode(EXAMPLE, image_token_counts=[4, 2])
    block = [
        VISION_START_ID,
        *[IMAGE_PAD_ID] * 4,
        VISION_END_ID,
        VISION_START_ID,
        *[IMAGE_PAD_ID] * 2,
        VISION_END_ID,
        198,
    ]
    assert list(record.input_ids[36 : 36 + len(block)]) == block
    assert record.image_blocks == ((37, 4), (43, 2))
    shift = len(block)
    assert record.input_tokens == plain.input_tokens + shift
    assert record.state_start == 36 + shift
    for a, b in zip(record.questions, plain.questions, strict=True):
        assert a.question_span == (b.question_span[0] + shift, b.question_span[1] + shift)
        assert a.option_spans == tuple((s + shift, e + shift) for s, e in b.option_spans)


class CountingTokenizer:
    """Wraps a tokenizer, counting the texts it is asked to tokenize; optionally maps some texts to no ids."""

    def __init__(self, inner: ClefTokenizer, empty: Sequence[str] = ()) -> None:
        self.inner = inner
        self.empty = set(empty)
        self.texts: list[str] = []

    def encode(self, text: str) -> list[int]:
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        self.texts += texts
        return [
            [] if t in self.empty else ids
            for t, ids in zip(texts, self.inner.encode_many(texts), strict=True)
        ]


def test_piece_cache_skips_tokenizing_seen_pieces(tok: ClefTokenizer) -> None:
    counting = CountingTokenizer(tok)
    encoder = Encoder(counting)
    first = encoder.encode(EXAMPLE)
    counting.texts.clear()
    again = encoder.encode(EXAMPLE)
    assert counting.texts == []  # nothing tokenized the second time
    assert again == first
    new_schema = dict(EXAMPLE, questions={"other": {"type": "noul", "instructions": "A new question?"}})
    encoder.encode(new_schema)
    state_text = render(EXAMPLE["state"])
    assert state_text not in counting.texts  # the state was not tokenized again
    assert "A new question?" in counting.texts


def test_pieces_rendering_to_no_token_are_refused(tok: ClefTokenizer) -> None:
    request = {
        "state": "s",
        "questions": {"q": {"type": "choice", "instructions": "pick", "criteria": {"a": None, "b": None}}},
    }
    with pytest.raises(RequestValidationError) as info:
        Encoder(CountingTokenizer(tok, empty=["pick"])).encode(request)
    assert info.value.errors[0]["loc"] == ("questions", "q", "instructions")
    with pytest.raises(RequestValidationError) as info:
        Encoder(CountingTokenizer(tok, empty=['{"option_id":"b"}'])).encode(request)
    assert info.value.errors[0]["loc"] == ("questions", "q", "criteria", "b")


def test_unrenderable_python_values_are_validation_errors(tok: ClefTokenizer) -> None:
    request = {"state": {"x": {1, 2}}, "questions": {"q": {"type": "noul"}}}
    with pytest.raises(RequestValidationError) as info:
        Encoder(tok).encode(request)
    # Refused at validation, naming the value inside the state (a set is not JSON).
    assert info.value.errors[0]["loc"] == ("state", "x")
    assert info.value.errors[0]["type"] == "invalid_json_value"


def test_concurrent_encoding_is_consistent(tok: ClefTokenizer) -> None:
    encoder = Encoder(tok)
    requests = [dict(EXAMPLE, state=f"state number {i} " * (i % 7 + 1)) for i in range(40)]
    expected = [as_tuple(Encoder(tok).encode(r)) for r in requests]
    results: dict[int, Any] = {}

    def work(offset: int) -> None:
        for k in range(len(requests)):
            i = (k + offset) % len(requests)
            results[(offset, i)] = as_tuple(encoder.encode(requests[i]))  # type: ignore[index]

    threads = [threading.Thread(target=work, args=(o,)) for o in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[(o, i)] == expected[i] for o in range(6) for i in range(len(requests)))  # type: ignore[index]


def test_record_is_immutable(tok: ClefTokenizer) -> None:
    record = Encoder(tok).encode(EXAMPLE)
    with pytest.raises(AttributeError):
        record.input_ids = ()  # type: ignore[misc]
    assert isinstance(record.input_ids, tuple)
    as_json = record.to_json()
    assert set(as_json) == {"input_ids", "questions", "truncated_state_tokens"}
    assert set(as_json["questions"][0]) == {
        "question_id",
        "question_type",
        "question_span",
        "option_spans",
        "option_ids",
    }
