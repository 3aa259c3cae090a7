"""Property-based fuzzing of the protocol and the encoder: any JSON value in any field of a System One or
decisions body either encodes into a well-formed record or raises the protocol's own error
(:class:`ClefError`: ``RequestValidationError`` / ``InputTooLongError``) - never another exception, and
never a question or option span that is empty or outside the input."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clef_runtime.encoding.encoder import EncodedRecord, Encoder
from clef_runtime.encoding.tokenizer import ClefTokenizer
from clef_runtime.protocol.decisions import parse_decisions_request, to_systemone
from clef_runtime.protocol.errors import ClefError
from clef_runtime.protocol.systemone import parse_request

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

# Text with the awkward parts of Unicode: surrogates are excluded (JSON decoders never produce them from
# valid UTF-8), everything else (controls, combining marks, astral planes, U+0000) is in.
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
# No subnormal floats: a model loaded by another test in the same thread turns on flush-to-zero, and
# hypothesis then refuses to generate them (conftest.py turns it off again; this keeps the file safe alone).
finite_floats = st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)
scalars = st.none() | st.booleans() | st.integers() | finite_floats | text
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=12,
)

# Plausible values per field, so that the fuzzer also reaches the encoder (purely random JSON is rejected
# by the validator almost always).
question_types = st.sampled_from(["noul", "choice", "score", "box", "", "NOUL"]) | json_values
criteria = (
    st.dictionaries(text, st.none() | text | json_values, max_size=5)
    | st.lists(text | json_values, max_size=5)
    | json_values
)
question = st.fixed_dictionaries(
    {},
    optional={
        "type": question_types,
        "instructions": text | json_values,
        "criteria": criteria,
        "extra": json_values,
    },
)
questions = st.dictionaries(text, question | json_values, max_size=4) | json_values
systemone_body = st.fixed_dictionaries(
    {},
    optional={
        "model": text | json_values,
        "state": text | json_values,
        "questions": questions,
        "images": st.lists(text | json_values, max_size=2) | json_values,
        "unknown": json_values,
    },
)


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    # A small max_length so truncation and schema-too-long paths are reached.
    return Encoder(ClefTokenizer.default(), max_length=160)


def check_record(record: EncodedRecord, question_count: int) -> None:
    """Every span is non-empty and inside the input; options and questions line up."""
    n = record.input_tokens
    assert 0 < n <= 160
    assert 0 <= record.state_start <= record.state_end <= n
    assert record.truncated_state_tokens >= 0
    assert len(record.questions) == question_count
    for encoded in record.questions:
        start, end = encoded.question_span
        assert 0 <= start < end <= n, encoded
        assert len(encoded.option_spans) == len(encoded.option_ids) >= 1
        for option_start, option_end in encoded.option_spans:
            assert 0 <= option_start < option_end <= n, encoded


def encode_or_protocol_error(encoder: Encoder, body: Any) -> None:
    try:
        request = parse_request(body)
        record = encoder.encode(request)
    except ClefError as error:
        assert str(error)  # a message the caller can read
        return
    check_record(record, len(request.questions))


@FUZZ
@given(body=systemone_body)
def test_any_systemone_body_encodes_or_raises_the_protocol_error(encoder: Encoder, body: Any) -> None:
    encode_or_protocol_error(encoder, body)


def valid_body(draw: st.DrawFn) -> dict[str, Any]:
    """A valid System One body with random contents."""
    qtype = draw(st.sampled_from(["noul", "choice", "score"]))
    options = draw(st.lists(text, min_size=2, max_size=6, unique=True))
    spec: dict[str, Any] = {"type": qtype, "instructions": draw(text | json_values)}
    if qtype == "choice":
        spec["criteria"] = {option: draw(st.none() | text) for option in options}
    elif qtype == "score":
        spec["criteria"] = options
    return {"model": "jev-latest", "state": draw(text | json_values), "questions": {"q": spec}}


# Every place a client can put a value, as a path into valid_body's result.
FIELD_PATHS: list[tuple[str, ...]] = [
    (),
    ("model",),
    ("state",),
    ("images",),
    ("questions",),
    ("questions", "q"),
    ("questions", "q", "type"),
    ("questions", "q", "instructions"),
    ("questions", "q", "criteria"),
    ("questions", "q", "unknown"),
    ("questions", "other"),
]


@st.composite
def mutated_body(draw: st.DrawFn) -> Any:
    """A valid body with one field (any path above, existing or new) replaced by an arbitrary JSON value."""
    body = valid_body(draw)
    path = draw(st.sampled_from(FIELD_PATHS))
    value = draw(json_values)
    if not path:
        return value
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


@FUZZ
@given(body=mutated_body())
def test_any_json_value_in_any_field_encodes_or_raises_the_protocol_error(
    encoder: Encoder, body: Any
) -> None:
    encode_or_protocol_error(encoder, body)


@FUZZ
@given(body=json_values)
def test_any_json_document_encodes_or_raises_the_protocol_error(encoder: Encoder, body: Any) -> None:
    encode_or_protocol_error(encoder, body)


@FUZZ
@given(
    state=text | json_values,
    qtype=st.sampled_from(["noul", "choice", "score"]),
    options=st.lists(text, min_size=2, max_size=6, unique=True),
    question_id=text,
)
def test_well_typed_bodies_with_any_content_encode(
    encoder: Encoder, state: Any, qtype: str, options: list[str], question_id: str
) -> None:
    """With only the contents random, a rejection must be a validation error on a limit (id length,
    empty id) - checked by encoding whatever parses."""
    spec: dict[str, Any] = {"type": qtype, "instructions": "decide"}
    if qtype == "choice":
        spec["criteria"] = dict.fromkeys(options)
    elif qtype == "score":
        spec["criteria"] = options[:10]
    encode_or_protocol_error(encoder, {"state": state, "questions": {question_id: spec}})


decision_question = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["predicate", "choice", "score"]) | json_values,
        "name": text | json_values,
        "instructions": text | json_values,
        "choices": st.lists(st.fixed_dictionaries({"value": text | st.booleans()}) | json_values, max_size=4),
        "levels": st.lists(st.fixed_dictionaries({"label": text}) | json_values, max_size=4),
    },
)
decisions_body = st.fixed_dictionaries(
    {},
    optional={
        "model": text | json_values,
        "input": text | json_values | st.lists(json_values, max_size=3),
        "questions": st.lists(decision_question | json_values, max_size=4) | json_values,
    },
)


@FUZZ
@given(body=decisions_body)
def test_any_decisions_body_maps_and_encodes_or_raises_the_protocol_error(
    encoder: Encoder, body: Any
) -> None:
    try:
        systemone, _plan = to_systemone(parse_decisions_request(body))
    except ClefError:
        return
    encode_or_protocol_error(encoder, systemone)
