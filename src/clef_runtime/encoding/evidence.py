"""Evidence units: the parts of the rendered state that an explanation's token weights are reported on.

An explanation weighs the state's tokens; a person reads words, fields and sentences. This module maps one
onto the other without torch:

- :func:`token_char_offsets`: each state token's character range in the rendered state;
- :func:`render_json_paths`: the rendered text of a JSON state with the range and RFC 6901 pointer of every
  key and leaf value;
- :func:`state_units`: the units of a granularity (``word``, ``token``, ``field``) and, for each token, the
  units its weight goes to;
- :func:`rank_units` and :func:`evidence_items`: the strongest units as the wire's ``x_evidence`` items.

Offsets are character (Python str) indexes into ``render(state)``, the exact text the prompt holds.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from clef_runtime.encoding.render import _ENCODER, render

__all__ = [
    "EvidenceUnit",
    "Granularity",
    "JsonMember",
    "RenderedJson",
    "StateUnits",
    "evidence_items",
    "rank_units",
    "render_json_paths",
    "significant",
    "state_units",
    "token_char_offsets",
]

Granularity = Literal["word", "token", "field"]

_WORD = re.compile(r"\w+")
# Lines break at what str.splitlines breaks at; sentences after . ! ? followed by whitespace.
_SEGMENT_BREAK = re.compile(r"[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]+|(?<=[.!?])\s+")

_Payload = TypeVar("_Payload")


class _OffsetTokenizer(Protocol):
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


def token_char_offsets(tokenizer: _OffsetTokenizer, text: str) -> list[tuple[int, int]]:
    """Character offsets of each token of ``tokenizer.encode(text)`` in ``text`` (they tile the text; see
    :meth:`~clef_runtime.encoding.tokenizer.ClefTokenizer.encode_with_offsets`)."""
    return tokenizer.encode_with_offsets(text)[1]


# ---------------------------------------------------------------------------------------------------------
# JSON pointers of a rendered JSON value
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JsonMember:
    """A key, or a leaf value (scalar or empty container), of a rendered JSON value.

    ``start``/``end``: its character range (inside the quotes for a string); ``path``: the RFC 6901 pointer
    of the member it belongs to (a key and its member's value share it); ``is_key``: which of the two."""

    start: int
    end: int
    path: str
    is_key: bool


@dataclass(frozen=True, slots=True)
class RenderedJson:
    """``render(value)`` for a JSON value, with its keys and leaf values in text order."""

    text: str
    members: tuple[JsonMember, ...]


class _Unmappable(Exception):
    """The value renders as JSON but its members cannot be given pointers (e.g. a non-str dict key)."""


def _pointer_token(key: str) -> str:
    """``key`` as one reference token of a JSON pointer (RFC 6901: ``~`` as ``~0``, ``/`` as ``~1``)."""
    return key.replace("~", "~0").replace("/", "~1")


class _JsonPathWriter:
    """Writes a value the way ``render`` does, piece by piece, noting where each key and leaf lands."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.length = 0
        self.members: list[JsonMember] = []

    def _write(self, piece: str) -> None:
        self.pieces.append(piece)
        self.length += len(piece)

    def _member(self, encoded: str, path: str, *, quoted: bool, is_key: bool) -> None:
        start = self.length
        self._write(encoded)
        inset = 1 if quoted else 0
        self.members.append(JsonMember(start + inset, self.length - inset, path, is_key))

    def value(self, value: Any, path: str) -> None:
        # The order of json's own checks: a str (subclass) is a string, a dict a mapping, a list or tuple an
        # array; everything else is a scalar that json's encoder writes (or rejects) itself.
        if isinstance(value, dict) and value:
            self._object(value, path)
        elif isinstance(value, (list, tuple)) and value:
            self._array(value, path)
        else:
            self._member(_ENCODER.encode(value), path, quoted=isinstance(value, str), is_key=False)

    def _object(self, value: dict[Any, Any], path: str) -> None:
        if not all(isinstance(key, str) for key in value):
            raise _Unmappable("a dict key is not a str")
        self._write("{")
        for index, key in enumerate(sorted(value)):
            if index:
                self._write(",")
            member_path = f"{path}/{_pointer_token(key)}"
            self._member(_ENCODER.encode(key), member_path, quoted=True, is_key=True)
            self._write(":")
            self.value(value[key], member_path)
        self._write("}")

    def _array(self, value: Sequence[Any], path: str) -> None:
        self._write("[")
        for index, item in enumerate(value):
            if index:
                self._write(",")
            self.value(item, f"{path}/{index}")
        self._write("]")


def render_json_paths(value: Any) -> RenderedJson | None:
    """``render(value)`` with the character range and JSON pointer of every key and leaf value.

    A top-level leaf has the pointer ``""``. Returns None when there are no pointers to give: ``value`` is a
    str (a text state renders as itself), or it renders but cannot be mapped (a non-str dict key, which only
    the Python API can send; nesting deeper than Python's recursion limit). Raises what ``render`` raises for
    a value that is not JSON-serialisable.
    """
    text = render(value)
    if isinstance(value, str):
        return None
    writer = _JsonPathWriter()
    try:
        writer.value(value, "")
    except (_Unmappable, RecursionError):
        return None
    # The pieces are json's own encodings, so they join to the same text; were a type ever written
    # differently, offsets into a different text would be wrong, so no pointers rather than wrong ones.
    if "".join(writer.pieces) != text:
        return None
    return RenderedJson(text, tuple(writer.members))


# ---------------------------------------------------------------------------------------------------------
# Units of a granularity, and how each token's weight is shared among them
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EvidenceUnit:
    """One span of the rendered state that evidence is reported on: ``text == rendered[start:end]``, and the
    JSON pointer of the key or leaf it lies in (None for a text state, or outside every key and leaf)."""

    start: int
    end: int
    text: str
    path: str | None


@dataclass(frozen=True, slots=True)
class StateUnits:
    """A state's units in text order, and for each kept state token the ``(unit index, share)`` pairs its
    weight goes to (shares of one token sum to 1; empty when the token touches no unit)."""

    units: tuple[EvidenceUnit, ...]
    token_shares: tuple[tuple[tuple[int, float], ...], ...]


class _Regions(Generic[_Payload]):
    """Disjoint non-empty character ranges, each with a payload; which of them a range overlaps."""

    def __init__(self, ranges: Sequence[tuple[int, int, _Payload]]) -> None:
        self._ranges = sorted((r for r in ranges if r[0] < r[1]), key=lambda r: r[0])
        self._ends = [end for _, end, _ in self._ranges]

    def overlaps(self, start: int, end: int) -> Iterator[tuple[int, _Payload]]:
        """``(characters in common, payload)`` of each range that ``[start, end)`` overlaps, in text order."""
        index = bisect.bisect_right(self._ends, start)
        while index < len(self._ranges) and self._ranges[index][0] < end:
            range_start, range_end, payload = self._ranges[index]
            yield min(end, range_end) - max(start, range_start), payload
            index += 1


def _path_of(paths: _Regions[str] | None, start: int, end: int) -> str | None:
    """The pointer of the key or leaf that shares the most characters with ``[start, end)`` (the first on a
    tie), or None."""
    if paths is None:
        return None
    best: tuple[int, str | None] = (0, None)
    for overlap, path in paths.overlaps(start, end):
        if overlap > best[0]:
            best = (overlap, path)
    return best[1]


def _effective_range(start: int, end: int) -> tuple[int, int]:
    """The characters a token's weight is about: its range, or for an empty range (a token holding part of
    a character another token owns) the character just before it, or just after at the very start."""
    if start < end:
        return start, end
    return (start - 1, start) if start > 0 else (0, 1)


def _overlap_shares(
    token_offsets: Sequence[tuple[int, int]], regions: _Regions[int]
) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Each token's weight shared among the units whose regions it overlaps, in proportion to the characters
    it has in each."""
    all_shares: list[tuple[tuple[int, float], ...]] = []
    for token_start, token_end in token_offsets:
        chars: dict[int, int] = {}
        for overlap, unit_index in regions.overlaps(*_effective_range(token_start, token_end)):
            chars[unit_index] = chars.get(unit_index, 0) + overlap
        total = sum(chars.values())
        all_shares.append(tuple((unit_index, count / total) for unit_index, count in chars.items()))
    return tuple(all_shares)


def _units_over(
    rendered: str, ranges: Sequence[tuple[int, int]], paths: _Regions[str] | None
) -> tuple[EvidenceUnit, ...]:
    return tuple(
        EvidenceUnit(start, end, rendered[start:end], _path_of(paths, start, end)) for start, end in ranges
    )


def _word_units(
    rendered: str, covered_end: int, token_offsets: Sequence[tuple[int, int]], paths: _Regions[str] | None
) -> StateUnits:
    # Words are found in the covered text only, so a word the cut goes through ends at the cut.
    ranges = [match.span() for match in _WORD.finditer(rendered, 0, covered_end)]
    regions = _Regions([(start, end, index) for index, (start, end) in enumerate(ranges)])
    return StateUnits(_units_over(rendered, ranges, paths), _overlap_shares(token_offsets, regions))


def _token_units(
    rendered: str, token_offsets: Sequence[tuple[int, int]], paths: _Regions[str] | None
) -> StateUnits:
    ranges = [(start, end) for start, end in token_offsets if start < end]
    # A token with an empty range holds part of a character the token before it owns: it joins that unit
    # (the one after it when no token before it has a range).
    owner: list[int] = []
    unit_index = -1
    for start, end in token_offsets:
        if start < end:
            unit_index += 1
        owner.append(max(unit_index, 0))
    shares = tuple(((owner_index, 1.0),) if ranges else () for owner_index in owner)
    return StateUnits(_units_over(rendered, ranges, paths), shares)


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    """``[start, end)`` without surrounding whitespace; None when nothing is left."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _text_segments(text: str, end: int) -> list[tuple[int, int]]:
    """The lines and sentences of ``text[:end]``, trimmed, none empty."""
    segments: list[tuple[int, int]] = []
    segment_start = 0
    for match in [*_SEGMENT_BREAK.finditer(text, 0, end), None]:
        segment = _trimmed(text, segment_start, match.start() if match else end)
        if segment is not None:
            segments.append(segment)
        if match:
            segment_start = match.end()
    return segments


def _text_field_units(
    rendered: str, covered_end: int, token_offsets: Sequence[tuple[int, int]]
) -> StateUnits:
    ranges = _text_segments(rendered, covered_end)
    regions = _Regions([(start, end, index) for index, (start, end) in enumerate(ranges)])
    return StateUnits(_units_over(rendered, ranges, None), _overlap_shares(token_offsets, regions))


def _leaf_range(member: JsonMember, covered_end: int) -> tuple[int, int] | None:
    """A leaf value's unit range, cut at ``covered_end``; an empty string keeps its quotes, so that "this
    field is empty" can be reported."""
    start, end = member.start, member.end
    if start == end:
        start, end = start - 1, end + 1
    end = min(end, covered_end)
    return (start, end) if start < end else None


def _json_field_units(
    mapped: RenderedJson, covered_end: int, token_offsets: Sequence[tuple[int, int]]
) -> StateUnits:
    ranges: list[tuple[int, int]] = []
    paths: list[str] = []
    for member in mapped.members:
        leaf = None if member.is_key else _leaf_range(member, covered_end)
        if leaf is not None:
            ranges.append(leaf)
            paths.append(member.path)
    unit_of_path = {path: index for index, path in enumerate(paths)}
    # A key's characters count for its member's value when that value is a leaf (then it has a unit).
    key_regions = [
        (member.start, min(member.end, covered_end), unit_of_path[member.path])
        for member in mapped.members
        if member.is_key and member.path in unit_of_path
    ]
    regions = _Regions([*((start, end, index) for index, (start, end) in enumerate(ranges)), *key_regions])
    units = tuple(
        EvidenceUnit(start, end, mapped.text[start:end], path)
        for (start, end), path in zip(ranges, paths, strict=True)
    )
    return StateUnits(units, _overlap_shares(token_offsets, regions))


def _covered_end(rendered: str, token_offsets: Sequence[tuple[int, int]]) -> int:
    """Where the kept tokens' text ends; raises ``ValueError`` for a range outside ``rendered``."""
    for start, end in token_offsets:
        if not 0 <= start <= end <= len(rendered):
            raise ValueError(
                f"token offsets ({start}, {end}) are not a range of the {len(rendered)}-char state"
            )
    return max((end for _, end in token_offsets), default=0)


def state_units(
    state: Any, rendered: str, token_offsets: Sequence[tuple[int, int]], granularity: Granularity
) -> StateUnits:
    """The units of ``state`` at ``granularity`` and how each kept state token's weight is shared among them.

    ``rendered`` is ``render(state)``; ``token_offsets`` are the character ranges of the state tokens the
    prompt kept (the state may be cut at its end), so units exist only for the text they cover.

    - ``word``: runs of Unicode word characters; a token's weight goes to the words it overlaps, in
      proportion to its characters in each (none for a token of punctuation or spaces).
    - ``token``: each token with a non-empty range; a token with an empty range (part of a character that the
      token before it owns) adds to the unit of the token before it.
    - ``field``: a JSON state's leaf values (an empty string with its quotes), a key's characters counting
      for its member's value when that value is a leaf; a text state's lines and sentences (broken at line
      breaks and after ``.``, ``!`` or ``?`` followed by whitespace), trimmed.

    For ``word`` and ``token`` on a JSON state, a unit's path is the pointer of the key or leaf it shares the
    most characters with. A JSON state that :func:`render_json_paths` cannot map gets no paths, and at
    ``field`` the units of a text state.

    Raises:
        ValueError: an offset pair is not a range of ``rendered``, or ``granularity`` is unknown.
    """
    covered_end = _covered_end(rendered, token_offsets)
    mapped = None if isinstance(state, str) else render_json_paths(state)
    if mapped is not None and mapped.text != rendered:
        mapped = None  # offsets into another text: report spans without pointers rather than wrong ones
    paths = None if mapped is None else _Regions([(m.start, m.end, m.path) for m in mapped.members])
    if granularity == "word":
        return _word_units(rendered, covered_end, token_offsets, paths)
    if granularity == "token":
        return _token_units(rendered, token_offsets, paths)
    if granularity == "field":
        if mapped is None:
            return _text_field_units(rendered, covered_end, token_offsets)
        return _json_field_units(mapped, covered_end, token_offsets)
    raise ValueError(f"unknown granularity {granularity!r}; expected word, token or field")


# ---------------------------------------------------------------------------------------------------------
# Ranking units and writing the wire items
# ---------------------------------------------------------------------------------------------------------


def rank_units(
    units: StateUnits, token_weights: Sequence[float], top_k: int, *, by_magnitude: bool
) -> list[tuple[int, float]]:
    """The ``top_k`` strongest units as ``(unit index, weight)``, strongest first.

    A unit's weight is the sum over tokens of its share of the token's weight. Strongest is the largest
    weight, or the largest ``|weight|`` when ``by_magnitude`` (signed methods); ties go to the earlier unit.
    A unit no token shares in, or whose weight is NaN, is never returned.

    Raises:
        ValueError: ``token_weights`` does not have one weight per token of ``units``.
    """
    if len(token_weights) != len(units.token_shares):
        raise ValueError(f"{len(token_weights)} token weights for {len(units.token_shares)} state tokens")
    totals: dict[int, float] = {}
    for shares, token_weight in zip(units.token_shares, token_weights, strict=True):
        for unit_index, share in shares:
            totals[unit_index] = totals.get(unit_index, 0.0) + share * float(token_weight)
    ranked = [(index, weight) for index, weight in totals.items() if not math.isnan(weight)]
    if by_magnitude:
        ranked.sort(key=lambda item: (-abs(item[1]), item[0]))
    else:
        ranked.sort(key=lambda item: (-item[1], item[0]))
    return ranked[: max(top_k, 0)]


def significant(weight: float, digits: int = 6) -> float:
    """``weight`` to ``digits`` significant digits: attributions span many orders of magnitude (a saturated
    answer's are small), so a fixed number of decimals would round real evidence to 0."""
    return float(f"{weight:.{digits}g}")


def evidence_items(
    units: StateUnits, ranked: Sequence[tuple[int, float]], *, ndigits: int = 6
) -> list[dict[str, Any]]:
    """The wire's ``x_evidence`` items of ``ranked`` units, in order: ``{"text", "start", "end", "weight"}``
    with the weight to ``ndigits`` significant digits, plus ``"path"`` when the unit has one."""
    items: list[dict[str, Any]] = []
    for unit_index, weight in ranked:
        unit = units.units[unit_index]
        item: dict[str, Any] = {
            "text": unit.text,
            "start": unit.start,
            "end": unit.end,
            "weight": significant(weight, ndigits),
        }
        if unit.path is not None:
            item["path"] = unit.path
        items.append(item)
    return items
