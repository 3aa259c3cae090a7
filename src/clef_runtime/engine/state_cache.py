"""The state cache: a prefix tree of backbone states over the state's token ids, reused by later requests.

A Clef row is ``prefix + [images] + state + schema + suffix``. Everything up to a position depends only on
the tokens before it (causal backbone), so a later request whose row starts with the same tokens - and, for
image rows, the same pixels - can resume from a snapshot taken there and run only the rest. Requests about
the same state with new questions resume at the state's end; a state that grew (a conversation, an agent's
history, a log) resumes at the longest cached prefix of its ids.

The tree (radix tree: each edge holds a run of ids) has one root per *head*: the 36-token prompt prefix
alone for text rows, or the prefix + image blocks with the images' pixel digests (`root_key`), which must
match exactly. Below a root, the ids are the state's. A node owns what grows with its own tokens only - a
*segment*: attention K/V and final-norm hidden rows of its run (`clef_runtime.model.backbone.StateSegment`),
so memory is linear in the tokens cached, not quadratic in a growing state - and, where a snapshot was taken
at its end, a *point* (`StatePoint`: DeltaNet conv and recurrent states there, and the next M-RoPE
position). A state is resumable exactly at the nodes that hold a point; restoring concatenates the segments
along the path. An image root holds the image block's segment and the point after it.

Memory: one LRU over nodes, bounded by the bytes they hold (tensor bytes, counted exactly). Only nodes
without children are evicted (a node's segment is needed by every node below it), the least recently used
first; a node that loses its last child and holds no point goes with it. Lookups refresh the whole path.
``capacity_bytes=0`` disables storing. The tree is thread-safe; the engine calls it under its model lock.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "TEXT_ROOT",
    "CachedPoint",
    "CachedSegment",
    "Match",
    "StateCache",
    "image_digest",
    "root_key",
    "state_key",
]

_DIGEST_BYTES = 32

TEXT_ROOT = b""
"""The root key of rows without images: the prompt prefix, whose state the engine keeps outside the tree."""


class CachedSegment(Protocol):
    """What the tree needs of a segment (`StateSegment` provides it)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def length(self) -> int: ...

    def slice(self, begin: int, end: int) -> CachedSegment: ...


class CachedPoint(Protocol):
    """What the tree needs of a point (`StatePoint` provides it)."""

    @property
    def nbytes(self) -> int: ...


def image_digest(pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> bytes:
    """A 32-byte BLAKE2b digest of an image as the vision tower sees it: its grid and its pixel values
    (dtype, shape and bytes). Two images share a digest only if the tower would get identical input."""
    values = pixel_values.detach().to("cpu").contiguous()
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"clef-image")
    hasher.update(str(values.dtype).encode())
    hasher.update(array("q", [*values.shape, *grid_thw]).tobytes())
    # A uint8 view hashes the raw bytes without a copy (numpy cannot view bf16, torch can).
    hasher.update(values.reshape(-1).view(torch.uint8).numpy().data)
    return hasher.digest()


def _digest(person: bytes, ids: Sequence[int], image_digests: Iterable[bytes]) -> bytes:
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=person)
    hasher.update(array("i", ids).tobytes())
    for digest in image_digests:
        hasher.update(b"\x00image")
        hasher.update(digest)
    return hasher.digest()


def state_key(state_ids: Sequence[int], image_digests: Iterable[bytes] = ()) -> bytes:
    """The identity of a row's state part: ``state_ids`` = ``input_ids[:state_end]`` and the digests of
    the images whose pads are among them, in order (requests of one batch with the same key share one
    computation). Returns 32 bytes. Raises OverflowError for an id that does not fit 32 bits."""
    return _digest(b"clef-state", state_ids, image_digests)


def root_key(head_ids: Sequence[int], image_digests: Sequence[bytes]) -> bytes:
    """The tree root of a row: `TEXT_ROOT` without images, else a 32-byte digest of ``head_ids`` =
    ``input_ids[:state_start]`` (prompt prefix and image blocks) and the images' pixel digests."""
    return TEXT_ROOT if not image_digests else _digest(b"clef-head", head_ids, image_digests)


class _Node:
    """A tree node: the run of ids ``tokens`` below its parent, their ``segment`` and an optional
    ``point`` at its end. A root has no tokens; its segment is the image block (None for the text root)."""

    __slots__ = ("children", "key", "nbytes", "parent", "point", "segment", "tokens")

    def __init__(
        self,
        parent: _Node | None,
        tokens: tuple[int, ...],
        segment: CachedSegment | None,
        point: CachedPoint | None,
        key: bytes,
    ) -> None:
        self.parent = parent
        self.tokens = tokens
        self.segment = segment
        self.point = point
        self.key = key  # the root key of the tree it belongs to
        self.children: dict[int, _Node] = {}
        self.nbytes = 0
        self.size()

    def size(self) -> int:
        self.nbytes = (self.segment.nbytes if self.segment is not None else 0) + (
            self.point.nbytes if self.point is not None else 0
        )
        return self.nbytes


@dataclass(frozen=True, eq=False)
class Match:
    """The longest resumable prefix of a state that the tree holds.

    ``root``: whether the row's root is in the tree (always for text rows; an image row whose image block is
    not cached resumes from the prompt prefix). ``length``: state tokens covered (0: the root's own point).
    ``segments``: the segments from the root down to the resume point, in order (the image block's first);
    ``point``: the point to resume at (None for the text root: the engine's prompt-prefix state).
    ``start``: the node, an identity for grouping rows that resume at the same place.
    """

    root: bool
    length: int
    segments: tuple[CachedSegment, ...] = ()
    point: CachedPoint | None = None
    start: object | None = None


class StateCache:
    """The prefix tree of cached states, bounded by ``capacity_bytes``. Thread-safe.

    Counters (`stats`): ``hits`` / ``partials`` / ``misses`` (distinct states of a batch found whole, found in
    part, not found; the engine reports them with `record`), ``shared`` (requests that reused a state computed
    in the same batch), ``stores`` (points stored), ``evictions`` (nodes evicted), ``tokens_saved`` (backbone
    tokens not run thanks to a cached or shared state, prompt prefix included), ``reused_tokens`` (image and
    state tokens taken from the cache, summed over requests: their ``cached_tokens``).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._lock = threading.RLock()
        self._roots: dict[bytes, _Node] = {}
        # Every evictable node, least recently used first.
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self._bytes = 0
        self._counts = dict.fromkeys(
            ("hits", "partials", "misses", "shared", "stores", "evictions", "tokens_saved", "reused_tokens"),
            0,
        )
        self._text_root()

    def _text_root(self) -> _Node:
        root = self._roots.get(TEXT_ROOT)
        if root is None:
            root = self._roots[TEXT_ROOT] = _Node(None, (), None, None, TEXT_ROOT)
        return root

    @property
    def enabled(self) -> bool:
        """Whether states are stored at all (``capacity_bytes > 0``)."""
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        """Nodes held (the text root, which holds nothing, is not counted)."""
        with self._lock:
            return len(self._lru)

    # ------------------------------------------------------------------------------------------ lookup

    def lookup(self, root: bytes, ids: Sequence[int]) -> Match:
        """The deepest point on the path of ``ids`` (the state's ids) under ``root``, refreshing that path
        in the LRU. Counts nothing (see `record`)."""
        with self._lock:
            node = self._roots.get(root)
            if node is None:
                return Match(root=False, length=0)
            path = [node]
            best, best_length, position = 1, 0, 0
            while position < len(ids):
                child = node.children.get(ids[position])
                if child is None:
                    break
                end = position + len(child.tokens)
                if tuple(ids[position:end]) != child.tokens:
                    break  # diverges inside the node's run: no point there to resume at
                path.append(child)
                node, position = child, end
                if child.point is not None:
                    best, best_length = len(path), position
            kept = path[:best]
            self._touch(kept)
            return Match(
                root=True,
                length=best_length,
                segments=tuple(n.segment for n in kept if n.segment is not None),
                point=kept[-1].point,
                start=kept[-1],
            )

    def _touch(self, path: Iterable[_Node]) -> None:
        for node in path:  # root first: a node is never older than what lies below it
            if node in self._lru:
                self._lru.move_to_end(node)

    # ------------------------------------------------------------------------------------------ insert

    def insert(
        self,
        root: bytes,
        ids: Sequence[int],
        *,
        start: int,
        segment: CachedSegment,
        points: Mapping[int, CachedPoint],
        root_part: tuple[CachedSegment, CachedPoint] | None = None,
    ) -> int:
        """Store what a run computed for a state whose ids are ``ids``: ``segment`` covers the state's
        tokens ``start .. max(points)``; ``points`` maps state positions (1..len(ids)) to the points taken
        there. ``root_part``: the image block's segment and the point after it, for a root not in the tree.

        Existing nodes on the path are kept (split where a point falls inside one); missing ones are
        created, least recently used leaves elsewhere evicted to make room. Stops at the first part that
        does not fit. Returns the number of points stored.
        """
        if not self.enabled or (not points and root_part is None):
            return 0
        with self._lock:
            node = self._roots.get(root)
            if node is None:
                if root_part is None:
                    return 0
                node = _Node(None, (), root_part[0], root_part[1], root)
                if not self._make_room(node.nbytes, ()):
                    return 0
                self._roots[root] = node
                self._add(node)
                self._counts["stores"] += 1
            path = [node]
            stored, position = 0, 0
            targets = sorted(points)
            if not targets:
                return stored
            if targets[-1] > len(ids) or targets[0] < 1:
                raise ValueError(f"points {targets} outside 1..{len(ids)}")
            for target in targets:
                while position < target:
                    child = node.children.get(ids[position])
                    if child is not None:
                        common = _common_length(child.tokens, ids[position:target])
                        if common < len(child.tokens):
                            child = self._split(child, common)
                        node, position = child, position + common
                    else:
                        if position < start:
                            return stored  # the tokens before the run are not in the tree (evicted)
                        piece = segment.slice(position - start, target - start)
                        child = _Node(node, tuple(ids[position:target]), piece, None, root)
                        if not self._make_room(child.nbytes, path):
                            return stored
                        node.children[child.tokens[0]] = child
                        self._add(child)
                        node, position = child, target
                    path.append(node)
                if node.point is None:
                    point = points[target]
                    if not self._make_room(point.nbytes, path):
                        return stored
                    node.point = point
                    self._bytes -= node.nbytes
                    self._bytes += node.size()
                    self._counts["stores"] += 1
                    stored += 1
            self._touch(path)
            return stored

    def _add(self, node: _Node) -> None:
        self._lru[node] = None
        self._bytes += node.nbytes

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s run after ``at`` tokens; returns the new upper node (no point), parent of
        ``node``."""
        assert node.segment is not None and node.parent is not None
        upper = _Node(node.parent, node.tokens[:at], node.segment.slice(0, at), None, node.key)
        node.segment = node.segment.slice(at, len(node.tokens))
        node.tokens = node.tokens[at:]
        self._bytes -= node.nbytes
        node.size()
        node.parent.children[upper.tokens[0]] = upper
        upper.children[node.tokens[0]] = node
        node.parent = upper
        self._bytes += node.nbytes + upper.nbytes
        self._lru[upper] = None
        self._lru.move_to_end(upper, last=False)  # as old as its oldest user; refreshed with the path
        return upper

    def _make_room(self, size: int, keep: Sequence[_Node]) -> bool:
        """Evict least recently used leaves (never one in ``keep``) until ``size`` more bytes fit. Returns
        False when they cannot."""
        if size > self.capacity_bytes:
            return False
        kept = set(keep)
        while self._bytes + size > self.capacity_bytes:
            victim = next((n for n in self._lru if not n.children and n not in kept), None)
            if victim is None:
                return False
            self._evict(victim, kept)
        return True

    def _evict(self, node: _Node, keep: set[_Node]) -> None:
        while node is not None and not node.children and node not in keep:
            del self._lru[node]
            self._bytes -= node.nbytes
            self._counts["evictions"] += 1
            parent = node.parent
            if parent is None:
                del self._roots[node.key]
                return
            del parent.children[node.tokens[0]]
            # A node left without children and without a point can never be resumed at: it goes too.
            node = parent if parent.point is None and parent.parent is not None else None  # type: ignore[assignment]

    # ------------------------------------------------------------------------------------------ counters

    def record(self, status: str, count: int = 1) -> None:
        """Count ``count`` distinct states of a batch as ``"hit"``, ``"partial"`` or ``"miss"``."""
        name = {"hit": "hits", "partial": "partials", "miss": "misses"}[status]
        with self._lock:
            self._counts[name] += count

    def add_shared(self, count: int = 1) -> None:
        """Count requests served by a state computed earlier in the same batch."""
        with self._lock:
            self._counts["shared"] += count

    def add_saved(self, tokens: int, reused: int = 0) -> None:
        """Count backbone tokens not run thanks to a cached or shared state (``tokens``, prompt prefix
        included) and image + state tokens taken from the cache (``reused``)."""
        with self._lock:
            self._counts["tokens_saved"] += tokens
            self._counts["reused_tokens"] += reused

    def clear(self) -> None:
        """Drop every node (counters are kept)."""
        with self._lock:
            self._roots.clear()
            self._lru.clear()
            self._bytes = 0
            self._text_root()

    def stats(self) -> dict[str, int]:
        """A consistent snapshot of the counters (see the class docstring) and sizes: ``entries`` (nodes),
        ``points`` (resumable positions), ``bytes``, ``capacity_bytes``."""
        with self._lock:
            return {
                **self._counts,
                "entries": len(self._lru),
                "points": sum(1 for n in self._lru if n.point is not None),
                "bytes": self._bytes,
                "capacity_bytes": self.capacity_bytes,
            }

    def check(self) -> None:
        """Verify the tree's invariants (for tests): byte count, parent links, every leaf resumable.
        Raises AssertionError."""
        with self._lock:
            nodes = list(itertools.chain.from_iterable(_walk(root) for root in self._roots.values()))
            assert {n for n in nodes if n.key != TEXT_ROOT or n.parent is not None} == set(self._lru)
            assert self._bytes == sum(n.nbytes for n in self._lru)
            assert self._bytes <= self.capacity_bytes
            for node in nodes:
                for first, child in node.children.items():
                    assert child.parent is node and child.tokens and child.tokens[0] == first
                    assert child.segment is not None and child.segment.length == len(child.tokens)
                if not node.children and node.parent is not None:
                    assert node.point is not None, "a leaf without a point"


def _walk(node: _Node) -> Iterable[_Node]:
    yield node
    for child in node.children.values():
        yield from _walk(child)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count
