"""The tiktoken fast path must give exactly the HF tokenizer's ids, or defer to it."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from clef_runtime.encoding.fast_bpe import (
    FAST_PATH_ENV,
    FastQwenTokenizer,
    fast_path_applies,
    tokenizer_for_encoding,
)
from clef_runtime.encoding.tokenizer import ClefTokenizer, default_tokenizer_path

HAND_CASES = [
    "",
    "plain ASCII text, with punctuation!?",
    '{"a":1,"b":[1.5,null,true],"c":{"d":"e"}}',
    "def f(x):\n\treturn x**2  # comment\r\n",
    "   leading and trailing spaces   ",
    "\n\n\n\t\t  \r\n mixed whitespace",
    "non\u00a0breaking\u200dzero\ufeffwidth",
    "café naïve résumé e\u0301 a\u0300 o\u0308",
    "नमस्ते दुनिया สวัสดีชาวโลก 안녕하세요 こんにちは世界 你好，世界",
    "Привет мир 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "emoji 🙂👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️",
    "don't can't we'll I'M THEY'RE you've",
    "1234567890 3.14159 -0.0 1e-7 10**20",
    "control \x00\x01\x07\x1b chars",
    "> \u0338 ≯ = \u0338",
]

SPECIAL_CASES = [
    "<|im_start|>system\nhello<|im_end|>",
    "<think>\u0338",  # the one documented difference between HF and tiktoken
    "text <|image_pad|> text <tool_call>x</tool_call>",
    "<|endoftext|>",
]


@pytest.fixture(scope="module")
def fast(clef_tokenizer: ClefTokenizer) -> FastQwenTokenizer:
    wrapped = tokenizer_for_encoding(clef_tokenizer)
    assert isinstance(wrapped, FastQwenTokenizer)
    return wrapped


def test_hand_cases_equal_hf(fast: FastQwenTokenizer, clef_tokenizer: ClefTokenizer) -> None:
    before = fast.fast_calls
    assert fast.encode_many(HAND_CASES) == clef_tokenizer.encode_many(HAND_CASES)
    assert fast.fast_calls - before == len(HAND_CASES)  # all of them took the fast path


def test_special_token_text_defers_to_hf(fast: FastQwenTokenizer, clef_tokenizer: ClefTokenizer) -> None:
    before = fast.exact_calls
    assert fast.encode_many(SPECIAL_CASES) == clef_tokenizer.encode_many(SPECIAL_CASES)
    assert fast.exact_calls - before == len(SPECIAL_CASES)
    assert fast.encode("<think>\u0338")[0] == 248068


def test_lone_surrogate_defers_to_hf_and_raises_the_same(fast: FastQwenTokenizer) -> None:
    with pytest.raises(ValueError):
        fast.encode("bad \ud800 surrogate")


def test_random_vocab_concatenations_equal_hf(
    fast: FastQwenTokenizer, clef_tokenizer: ClefTokenizer, qwen_vocab_tokens: list[bytes]
) -> None:
    rng = random.Random(1234)
    texts = []
    for _ in range(3000):
        parts = [qwen_vocab_tokens[rng.randrange(len(qwen_vocab_tokens))] for _ in range(rng.randint(2, 5))]
        texts.append(b"".join(parts).decode("utf-8", errors="replace"))
    assert fast.encode_many(texts) == clef_tokenizer.encode_many(texts)


def test_random_character_fuzz_equals_hf(fast: FastQwenTokenizer, clef_tokenizer: ClefTokenizer) -> None:
    rng = random.Random(99)
    alphabet = (
        "abcXYZ019 _-.,:;'\"{}[]()<>|/\\\n\t\r\u00a0\u200d\u0301\u0308\u0338é日本🙂👍🏽🇫ไทยह"
        "<|im_start|><think>"
    )
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    assert fast.encode_many(texts) == clef_tokenizer.encode_many(texts)


@pytest.mark.slow
def test_applies_only_to_the_builtin_file(tmp_path: Path, clef_tokenizer: ClefTokenizer) -> None:
    assert fast_path_applies(clef_tokenizer)
    copy = tmp_path / "tokenizer.json"
    shutil.copyfile(default_tokenizer_path(), copy)
    assert fast_path_applies(ClefTokenizer.from_file(copy))
    # A checkpoint tokenizer.json that differs in any byte is authoritative: no fast path.
    data = json.loads(copy.read_text(encoding="utf-8"))
    data["added_tokens"][0]["content"] = "<|endoftext_other|>"
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    other.write_text(json.dumps(data), encoding="utf-8")
    other_tok = ClefTokenizer.from_file(other)
    assert not fast_path_applies(other_tok)
    assert tokenizer_for_encoding(other_tok) is other_tok


def test_can_be_switched_off(monkeypatch: pytest.MonkeyPatch, clef_tokenizer: ClefTokenizer) -> None:
    monkeypatch.setenv(FAST_PATH_ENV, "0")
    assert tokenizer_for_encoding(clef_tokenizer) is clef_tokenizer
