"""Tests for clef_runtime.encoding.evidence: token character offsets, JSON pointers of the rendered state,
the units of each granularity with their token shares, and ranking units into wire items."""

from __future__ import annotations

import json
import math
import random
import unicodedata
from typing import Any

import pytest

from clef_runtime.encoding import EvidenceUnit, StateUnits, evidence_items, rank_units, state_units
from clef_runtime.encoding.evidence import render_json_paths, token_char_offsets
from clef_runtime.encoding.fast_bpe import FastQwenTokenizer
from clef_runtime.encoding.render import render
from clef_runtime.encoding.tokenizer import ClefTokenizer

OFFSET_CASES = [
    "",
    "plain ASCII text, with punctuation!?",
    '{"a":1,"b":[1.5,null,true],"c":{"d":"e\\n\\"q\\""}}',
    "emoji 🙂👍🏽 👨\u200d👩\u200d👧\u200d👦 🇫🇷🇯🇵 ❤️ 😀😀",
    "日本語のテキスト 你好，世界 안녕하세요 नमस्ते",
    unicodedata.normalize("NFD", "café naïve résumé") + " a\u0301\u0301\u0301b",
    "lines\nand\ttabs\r\n\n\t\tend\n",
    " " * 40 + "x" + " " * 17,
    "a<|im_start|>user\nhi<|im_end|> <think>\u0338 done",
    "> \u0338 ≯ = \u0338 control \x00\x1b",
]


def _tiles(offsets: list[tuple[int, int]], text: str) -> bool:
    """Whether ``offsets`` cover ``text`` from 0 to its end, each starting where the one before ends."""
    ends = [0, *(end for _, end in offsets)]
    starts = [start for start, _ in offsets]
    return starts == ends[:-1] and ends[-1] == len(text) and all(s <= e for s, e in offsets)


# ---------------------------------------------------------------------------------------------------------
# Token character offsets
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", OFFSET_CASES)
def test_offsets_give_encode_ids_and_tile_the_text(clef_tokenizer: ClefTokenizer, text: str) -> None:
    ids, offsets = clef_tokenizer.encode_with_offsets(text)
    assert ids == clef_tokenizer.encode(text)
    assert len(offsets) == len(ids)
    assert _tiles(offsets, text)
    assert "".join(text[start:end] for start, end in offsets) == text


@pytest.mark.parametrize("text", OFFSET_CASES)
def test_each_token_with_its_empty_followers_decodes_to_its_text(
    clef_tokenizer: ClefTokenizer, text: str
) -> None:
    # A character split over tokens belongs to the first; the rest have an empty range after it. So a token
    # with a range, with the empty-range tokens after it, spells exactly that range (NFC, as encoded).
    ids, offsets = clef_tokenizer.encode_with_offsets(text)
    groups: list[tuple[list[int], int, int]] = []
    for token_id, (start, end) in zip(ids, offsets, strict=True):
        if start < end or not groups:
            groups.append(([token_id], start, end))
        else:
            groups[-1][0].append(token_id)
    for group_ids, start, end in groups:
        assert clef_tokenizer.decode(group_ids) == unicodedata.normalize("NFC", text[start:end])


def test_split_character_belongs_to_its_first_token(clef_tokenizer: ClefTokenizer) -> None:
    ids, offsets = clef_tokenizer.encode_with_offsets("\U0001f468")  # 4 UTF-8 bytes, several tokens
    assert len(ids) > 1
    assert offsets == [(0, 1), *[(1, 1)] * (len(ids) - 1)]


def test_nfd_combining_mark_belongs_to_the_token_of_its_base(clef_tokenizer: ClefTokenizer) -> None:
    text = unicodedata.normalize("NFD", "café é")  # c a f e U+0301 space e U+0301
    _, offsets = clef_tokenizer.encode_with_offsets(text)
    for mark in (4, 7):
        (holder,) = [(start, end) for start, end in offsets if start <= mark < end]
        assert holder[0] <= mark - 1  # the same token holds the base letter


def test_special_token_text_gets_its_own_range(clef_tokenizer: ClefTokenizer) -> None:
    text = "a<|im_start|>b"
    ids, offsets = clef_tokenizer.encode_with_offsets(text)
    special = ids.index(248045)
    assert text[slice(*offsets[special])] == "<|im_start|>"


def test_offsets_refuse_what_encode_refuses(clef_tokenizer: ClefTokenizer) -> None:
    with pytest.raises(ValueError, match="lone surrogate U\\+D800 at character 1"):
        clef_tokenizer.encode_with_offsets("a\ud800b")
    with pytest.raises(TypeError, match="expected str"):
        clef_tokenizer.encode_with_offsets(b"bytes")  # type: ignore[arg-type]


def test_fast_tokenizer_delegates_offsets_to_its_exact_tokenizer(clef_tokenizer: ClefTokenizer) -> None:
    fast = FastQwenTokenizer(clef_tokenizer)
    for text in OFFSET_CASES:
        ids, offsets = fast.encode_with_offsets(text)
        assert (ids, offsets) == clef_tokenizer.encode_with_offsets(text)
        assert ids == fast.encode(text)
        assert token_char_offsets(fast, text) == offsets


# ---------------------------------------------------------------------------------------------------------
# JSON pointers of the rendered state
# ---------------------------------------------------------------------------------------------------------

_KEY_CHARS = ["a", "b", "z", "~", "/", '"', "\\", "\n", "é", "日", "🙂", " ", "0", "\x01", "~1"]
_STRING_CHARS = [*_KEY_CHARS, "\t", "\u2028", "\ud7ff", "x y", "\u0301"]
_SCALARS: list[Any] = [
    0, -1, 2**70, -(2**64), 1250.0, 1e-7, 1e300, -0.0, 0.1, 3.14159, float("nan"), float("inf"),
    True, False, None, "", "plain",
]  # fmt: skip


def _random_string(rng: random.Random, chars: list[str]) -> str:
    return "".join(rng.choice(chars) for _ in range(rng.randint(0, 5)))


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.random()
    if depth <= 0 or kind < 0.4:
        return rng.choice([*_SCALARS, _random_string(rng, _STRING_CHARS), rng.uniform(-1e6, 1e6)])
    if kind < 0.7:
        return [_random_value(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    return {_random_string(rng, _KEY_CHARS): _random_value(rng, depth - 1) for _ in range(rng.randint(0, 4))}


def _resolve(value: Any, pointer: str) -> tuple[Any, str | None]:
    """The value at an RFC 6901 pointer, and the last key on the way (None for an array index or the root)."""
    key: str | None = None
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, list):
            value, key = value[int(token)], None
        else:
            value, key = value[token], token
    return value, key


def _leaf_and_key_count(value: Any) -> tuple[int, int]:
    if isinstance(value, dict) and value:
        counts = [_leaf_and_key_count(item) for item in value.values()]
        return sum(leaves for leaves, _ in counts), len(value) + sum(keys for _, keys in counts)
    if isinstance(value, list) and value:
        counts = [_leaf_and_key_count(item) for item in value]
        return sum(leaves for leaves, _ in counts), sum(keys for _, keys in counts)
    return 1, 0


def _in_quotes(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def test_rendered_text_is_render_and_every_member_points_at_its_text() -> None:
    rng = random.Random(40)
    for _ in range(400):
        value = _random_value(rng, depth=4)
        if isinstance(value, str):
            value = [value]  # a str state is text, not JSON
        mapped = render_json_paths(value)
        assert mapped is not None
        assert mapped.text == render(value)
        assert [m.start for m in mapped.members] == sorted(m.start for m in mapped.members)
        leaves, keys = _leaf_and_key_count(value)
        assert sum(not m.is_key for m in mapped.members) == leaves
        assert sum(m.is_key for m in mapped.members) == keys
        for member in mapped.members:
            target, key = _resolve(value, member.path)
            spelled = mapped.text[member.start : member.end]
            if member.is_key:
                assert key is not None and spelled == _in_quotes(key)
            elif isinstance(target, str):
                assert spelled == _in_quotes(target)
            else:
                assert spelled == render(target)


def test_pointers_escape_tilde_and_slash_and_index_arrays() -> None:
    value = {"a/b~c": 1, "messages": [{"content": "hi", "role": "user"}, {"content": "yo"}]}
    mapped = render_json_paths(value)
    assert mapped is not None
    paths = {(m.path, m.is_key): mapped.text[m.start : m.end] for m in mapped.members}
    assert paths[("/a~1b~0c", True)] == "a/b~c"
    assert paths[("/a~1b~0c", False)] == "1"
    assert paths[("/messages/1/content", False)] == "yo"
    assert paths[("/messages/0/role", False)] == "user"


def test_string_leaf_range_is_inside_its_quotes() -> None:
    mapped = render_json_paths({"k": 'say "hi"\n'})
    assert mapped is not None
    value = next(m for m in mapped.members if not m.is_key)
    assert mapped.text[value.start - 1] == '"' and mapped.text[value.end] == '"'
    assert mapped.text[value.start : value.end] == 'say \\"hi\\"\\n'


def test_top_level_scalar_and_empty_containers_are_leaves() -> None:
    for value, spelled in ((1250.0, "1250.0"), (None, "null"), ([], "[]"), ({}, "{}")):
        mapped = render_json_paths(value)
        assert mapped is not None
        assert [(m.path, m.is_key, mapped.text[m.start : m.end]) for m in mapped.members] == [
            ("", False, spelled)
        ]
    mapped = render_json_paths({"tags": [], "meta": {}})
    assert mapped is not None
    assert [(m.path, mapped.text[m.start : m.end]) for m in mapped.members if not m.is_key] == [
        ("/meta", "{}"),
        ("/tags", "[]"),
    ]


def test_unmappable_values_give_none_and_unrenderable_ones_raise_like_render() -> None:
    assert render_json_paths("a text state") is None
    assert render_json_paths({1: "int key"}) is None
    assert render_json_paths({"ok": {None: 1}}) is None
    with pytest.raises(TypeError):
        render_json_paths({"x": object()})


# ---------------------------------------------------------------------------------------------------------
# Units and token shares
# ---------------------------------------------------------------------------------------------------------


def _texts(units: StateUnits) -> list[str]:
    return [unit.text for unit in units.units]


def _texts_and_paths(units: StateUnits) -> list[tuple[str, str | None]]:
    return [(unit.text, unit.path) for unit in units.units]


def _rendered_offsets(tokenizer: ClefTokenizer, state: Any) -> tuple[str, list[tuple[int, int]]]:
    """``render(state)`` and its tokens' character offsets."""
    rendered = render(state)
    return rendered, token_char_offsets(tokenizer, rendered)


def _shares_by_text(units: StateUnits, token: int) -> dict[str, float]:
    return {units.units[index].text: share for index, share in units.token_shares[token]}


def test_word_shares_follow_word_characters() -> None:
    text = "a refund, ab cd"
    offsets = [(0, 1), (1, 5), (5, 8), (8, 9), (9, 14), (14, 15)]  # "a" " ref" "und" "," " ab c" "d"
    units = state_units(text, text, offsets, "word")
    assert _texts(units) == ["a", "refund", "ab", "cd"]
    assert _shares_by_text(units, 1) == {"refund": 1.0}
    assert _shares_by_text(units, 2) == {"refund": 1.0}
    assert units.token_shares[3] == ()
    assert _shares_by_text(units, 4) == {"ab": pytest.approx(2 / 3), "cd": pytest.approx(1 / 3)}
    assert all(unit.path is None for unit in units.units)


def test_word_units_stop_where_the_kept_tokens_stop() -> None:
    text = "please refund me now"
    units = state_units(text, text, [(0, 6), (6, 11)], "word")  # "please" " refu" kept, the rest cut
    assert _texts(units) == ["please", "refu"]
    assert units.units[1] == EvidenceUnit(7, 11, "refu", None)


def test_word_and_token_units_of_a_json_state_carry_pointers(clef_tokenizer: ClefTokenizer) -> None:
    state = {"ticket": {"body": "refund now", "tier": "gold"}}
    rendered, offsets = _rendered_offsets(clef_tokenizer, state)
    words = state_units(state, rendered, offsets, "word")
    assert _texts(words) == ["ticket", "body", "refund", "now", "tier", "gold"]
    # A word of a key has its member's pointer, like the words of the member's value.
    paths = ["/ticket", "/ticket/body", "/ticket/body", "/ticket/body", "/ticket/tier", "/ticket/tier"]
    assert [unit.path for unit in words.units] == paths
    tokens = state_units(state, rendered, offsets, "token")
    assert "".join(_texts(tokens)) == rendered
    by_text = {u.text: u.path for u in tokens.units}
    assert by_text[" now"] == "/ticket/body"
    assert by_text['{"'] is None  # punctuation outside every key and leaf


def test_token_units_give_empty_range_tokens_to_the_token_before(clef_tokenizer: ClefTokenizer) -> None:
    text = "hi \U0001f468 yo"
    offsets = token_char_offsets(clef_tokenizer, text)
    units = state_units(text, text, offsets, "token")
    assert len(units.units) == sum(start < end for start, end in offsets)
    owners = [shares[0][0] for shares in units.token_shares]
    assert owners == sorted(owners) and len(set(owners)) == len(units.units)
    emoji_unit = next(i for i, u in enumerate(units.units) if "\U0001f468" in u.text)
    assert owners.count(emoji_unit) > 1  # its split bytes all count for it
    leading = state_units("xy", "xy", [(0, 0), (0, 2)], "token")
    assert leading.token_shares == (((0, 1.0),), ((0, 1.0),))


def test_word_shares_of_a_split_character_go_to_its_word(clef_tokenizer: ClefTokenizer) -> None:
    text = "ok 𝔘𝔫𝔦 end"  # mathematical letters are word characters of several UTF-8 bytes each
    offsets = token_char_offsets(clef_tokenizer, text)
    assert any(start == end for start, end in offsets)
    units = state_units(text, text, offsets, "word")
    fraktur = _texts(units).index("𝔘𝔫𝔦")
    for (start, end), shares in zip(offsets, units.token_shares, strict=True):
        if start == end and 3 < start <= 6:
            assert shares == ((fraktur, 1.0),)


def test_json_field_units_are_leaves_and_keys_count_for_leaf_members(clef_tokenizer: ClefTokenizer) -> None:
    state = {"messages": [{"content": "refund please", "role": "user"}], "note": "", "vip": True}
    rendered, offsets = _rendered_offsets(clef_tokenizer, state)
    units = state_units(state, rendered, offsets, "field")
    assert _texts_and_paths(units) == [
        ("refund please", "/messages/0/content"),
        ("user", "/messages/0/role"),
        ('""', "/note"),
        ("true", "/vip"),
    ]
    for (start, end), shares in zip(offsets, units.token_shares, strict=True):
        spelled = rendered[start:end]
        if spelled == "vip":
            assert shares == ((3, 1.0),)
        if spelled == "messages":  # a key whose value is not a leaf has no unit
            assert shares == ()


def test_text_field_units_are_trimmed_lines_and_sentences(clef_tokenizer: ClefTokenizer) -> None:
    text = "Hello there. It costs 3.5 dollars!  Why?\n\n   Fine\u2028ok.\nlast"
    offsets = token_char_offsets(clef_tokenizer, text)
    units = state_units(text, text, offsets, "field")
    assert _texts(units) == ["Hello there.", "It costs 3.5 dollars!", "Why?", "Fine", "ok.", "last"]
    between = 0
    for (start, end), shares in zip(offsets, units.token_shares, strict=True):
        inside = any(unit.start < end and start < unit.end for unit in units.units)
        if start < end:
            assert (shares != ()) == inside  # a space inside a sentence is part of it; one between is not
            between += not inside
    assert between >= 4


def test_unmappable_json_state_gets_no_paths_and_text_fields() -> None:
    state = {1: "one. two"}  # only the Python API can send a non-str key
    rendered = render(state)
    offsets = [(i, i + 1) for i in range(len(rendered))]
    assert all(u.path is None for u in state_units(state, rendered, offsets, "word").units)
    assert _texts(state_units(state, rendered, offsets, "field")) == ['{"1":"one.', 'two"}']


def test_state_not_rendered_from_the_value_gets_no_paths() -> None:
    state = {"a": "x"}
    rendered = '{"a": "x"}'  # not render(state)
    units = state_units(state, rendered, [(0, len(rendered))], "word")
    assert _texts_and_paths(units) == [("a", None), ("x", None)]


def test_every_granularity_shares_each_token_whole(clef_tokenizer: ClefTokenizer) -> None:
    rng = random.Random(7)
    for _ in range(30):
        state = _random_value(rng, depth=3)
        rendered = render(state)
        offsets = token_char_offsets(clef_tokenizer, rendered)
        kept = offsets[: rng.randint(0, len(offsets))]
        covered = kept[-1][1] if kept else 0
        for granularity in ("word", "token", "field"):
            units = state_units(state, rendered, kept, granularity)
            assert len(units.token_shares) == len(kept)
            for unit in units.units:
                assert 0 <= unit.start < unit.end <= covered and unit.text == rendered[unit.start : unit.end]
            for shares in units.token_shares:
                assert shares == () or math.isclose(sum(share for _, share in shares), 1.0)
                assert all(0 <= index < len(units.units) for index, _ in shares)


def test_bad_offsets_and_granularity_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\(3, 9\)"):
        state_units("short", "short", [(3, 9)], "word")
    with pytest.raises(ValueError, match="unknown granularity 'line'"):
        state_units("short", "short", [(0, 5)], "line")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------
# Ranking and wire items
# ---------------------------------------------------------------------------------------------------------


def _units(count: int, shares: tuple[tuple[tuple[int, float], ...], ...]) -> StateUnits:
    units = tuple(EvidenceUnit(i, i + 1, f"u{i}", f"/u{i}" if i % 2 else None) for i in range(count))
    return StateUnits(units, shares)


def test_rank_sums_shares_times_weights_strongest_first() -> None:
    units = _units(4, (((0, 0.5), (1, 0.5)), ((1, 1.0),), ((2, 1.0),), ()))
    ranked = rank_units(units, [2.0, 1.0, -5.0, 100.0], 5, by_magnitude=False)
    assert ranked == [(1, 2.0), (0, 1.0), (2, -5.0)]  # unit 3 has no share: never returned
    assert rank_units(units, [2.0, 1.0, -5.0, 100.0], 2, by_magnitude=True) == [(2, -5.0), (1, 2.0)]
    assert rank_units(units, [2.0, 1.0, -5.0, 100.0], 0, by_magnitude=True) == []


def test_rank_breaks_ties_by_position_and_skips_nan() -> None:
    units = _units(3, (((2, 1.0),), ((0, 1.0),), ((1, 1.0),)))
    assert rank_units(units, [1.0, 1.0, -1.0], 3, by_magnitude=True) == [(0, 1.0), (1, -1.0), (2, 1.0)]
    assert rank_units(units, [1.0, float("nan"), 0.5], 3, by_magnitude=False) == [(2, 1.0), (1, 0.5)]


def test_rank_refuses_a_weight_count_that_does_not_match_the_tokens() -> None:
    with pytest.raises(ValueError, match="2 token weights for 3 state tokens"):
        rank_units(_units(1, ((), (), ())), [1.0, 2.0], 1, by_magnitude=False)


def test_evidence_items_keep_significant_digits_and_give_paths_only_when_known() -> None:
    units = _units(2, ())
    items = evidence_items(units, [(1, 0.123456789), (0, -2.0), (1, 0.0000123456)], ndigits=3)
    assert items == [
        {"text": "u1", "start": 1, "end": 2, "weight": 0.123, "path": "/u1"},
        {"text": "u0", "start": 0, "end": 1, "weight": -2.0},
        # A small weight keeps its digits: decimals would have rounded this evidence to 0.
        {"text": "u1", "start": 1, "end": 2, "weight": 0.0000123, "path": "/u1"},
    ]
    assert json.loads(json.dumps(items)) == items
