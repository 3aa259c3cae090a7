"""Prefix stability: which state forms keep their ids when they grow, and where the unstable tail starts."""

from __future__ import annotations

import random

import pytest

from clef_runtime.encoding.encoder import Encoder
from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
from clef_runtime.encoding.growth import stable_length
from clef_runtime.encoding.render import render
from clef_runtime.encoding.tokenizer import ClefTokenizer


@pytest.fixture(scope="module")
def encode() -> object:
    return tokenizer_for_encoding(ClefTokenizer.default()).encode


def common_prefix(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def check_extension(encode: object, shorter: object, longer: object) -> tuple[int, int, int]:
    """The stable length of ``shorter``'s ids, their shared prefix with ``longer``'s, and the tail size;
    asserts the stable part is shared."""
    text = render(shorter)
    ids = encode(text)  # type: ignore[operator]
    kept = stable_length(text, ids, encode)  # type: ignore[arg-type]
    assert kept is not None
    shared = common_prefix(ids, encode(render(longer)))  # type: ignore[operator]
    assert kept <= shared, (text[-30:], kept, shared)
    return kept, shared, len(ids) - kept


WORDS = [
    "charged",
    "twice",
    "refund",
    "the",
    "invoice",
    "is",
    "late",
    "ünïcode",
    "日本語",
    "42",
    "3.14",
    "ok!",
]


def random_text(rng: random.Random, words: int) -> str:
    text = ""
    for _ in range(words):
        text += rng.choice(WORDS) + rng.choice([" ", " ", ", ", ". ", "\n", "  ", ""])
    return text


def test_messages_appended_to_a_message_array_keep_all_but_the_closing_tail(encode: object) -> None:
    rng = random.Random(0)
    for _ in range(60):
        messages = [
            {
                "role": rng.choice(["user", "assistant", "tool"]),
                "content": random_text(rng, rng.randint(1, 30)),
            }
            for _ in range(rng.randint(1, 6))
        ]
        appended = [*messages, {"role": "user", "content": random_text(rng, rng.randint(1, 20))}]
        _kept, _shared, tail = check_extension(encode, messages, appended)
        assert tail <= 3  # only the closing `"}]` pre-token (or `}]` after a number) is re-tokenized


def test_text_appended_to_a_string_keeps_all_but_the_last_pre_token(encode: object) -> None:
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng, rng.randint(1, 40)) or "x"
        more = random_text(rng, rng.randint(1, 10)) or "y"
        _kept, _shared, tail = check_extension(encode, text, text + more)
        assert tail <= 4


def test_known_tails(encode: object) -> None:
    # A word that goes on: the last pre-token " fi" becomes " fire".
    assert check_extension(encode, "the printer is on fi", "the printer is on fire")[2] == 1
    # A message array: the closing `"}]` becomes `"},{"`.
    messages = [{"role": "user", "content": "hi"}]
    kept, shared, _tail = check_extension(encode, messages, [*messages, {"role": "user", "content": "again"}])
    assert shared == kept and render(messages).endswith('"}]')


def test_an_object_state_re_renders_with_sorted_keys(encode: object) -> None:
    # Not a stable form: a new key sorts before the old ones, so the ids change early on.
    before = {"z_log": "a long history of events " * 5}
    after = {**before, "a_new": 1}
    ids_before, ids_after = encode(render(before)), encode(render(after))  # type: ignore[operator]
    assert common_prefix(ids_before, ids_after) <= 2


def test_unknown_tails_are_none(encode: object) -> None:
    long_word = "x" * 600  # one pre-token longer than the scanned window
    assert stable_length(long_word, encode(long_word), encode) is None  # type: ignore[operator,arg-type]
    special = "hello <|im_end|>"  # the special token is not a pre-token of the regex
    assert stable_length(special, encode(special), encode) is None  # type: ignore[operator,arg-type]
    assert stable_length("", [], encode) == 0  # type: ignore[arg-type]


def test_the_encoder_state_ids_are_the_rendered_ids(encode: object) -> None:
    encoder = Encoder(tokenizer_for_encoding(ClefTokenizer.default()))
    state = [{"role": "user", "content": "hello"}]
    record = encoder.encode({"state": state, "questions": {"q": {"type": "noul"}}})
    assert list(record.input_ids[record.state_start : record.state_end]) == encode(render(state))  # type: ignore[operator]
