"""The state cache: backbone states at the end of a request's state, reused by later requests.

A Clef row is ``prefix + [images] + state + schema + suffix``. Everything up to the end of the state
(``EncodedRecord.state_end``) depends only on those tokens (causal backbone), so a later request whose row
starts with exactly the same tokens - and, for image rows, the same pixels - can continue from a snapshot
taken there and run only its schema and suffix. The snapshot (`clef_runtime.model.backbone.BackboneState`)
holds attention K/V, DeltaNet conv and recurrent states, the final-norm hidden rows of every cached position
(the joint head reads all of them) and the next M-RoPE position.

Keys (`state_key`): a BLAKE2b digest of the token ids ``input_ids[:state_end]`` (after truncation, so a
schema that forces a different cut gives another key) and of each image's pixel digest (`image_digest`:
every ``<|image_pad|>`` id is the same, whatever the picture).

`StateCache` is a thread-safe LRU bounded by the bytes its entries hold (tensor bytes, counted exactly).
An entry larger than the whole budget is not stored. ``capacity_bytes=0`` disables storing.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

__all__ = ["CachedState", "StateCache", "image_digest", "state_key"]

_DIGEST_BYTES = 32


class CachedState(Protocol):
    """What the cache needs of an entry: its size in bytes (`BackboneState` provides it)."""

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


def state_key(state_ids: Sequence[int], image_digests: Iterable[bytes] = ()) -> bytes:
    """The cache key of a row's state part: ``state_ids`` = ``input_ids[:state_end]`` and the digests of
    the images whose pads are among them, in order. Returns 32 bytes. Raises OverflowError for an id that
    does not fit 32 bits."""
    hasher = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"clef-state")
    hasher.update(array("i", state_ids).tobytes())
    for digest in image_digests:
        hasher.update(b"\x00image")
        hasher.update(digest)
    return hasher.digest()


class StateCache:
    """An LRU of states keyed by `state_key`, bounded by ``capacity_bytes``. Thread-safe.

    Counters: ``hits`` / ``misses`` (lookups), ``shared`` (requests that reused a state computed in the same
    batch), ``stores``, ``evictions``, ``tokens_saved`` (tokens not run thanks to a cached state; the engine
    reports them with `add_saved`).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[bytes, tuple[CachedState, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._shared = 0
        self._stores = 0
        self._evictions = 0
        self._tokens_saved = 0

    @property
    def enabled(self) -> bool:
        """Whether states are stored at all (``capacity_bytes > 0``)."""
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: bytes) -> CachedState | None:
        """The entry for ``key`` (now the most recently used), or None; counts a hit or a miss."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return found[0]

    def put(self, key: bytes, state: CachedState) -> bool:
        """Store ``state`` under ``key`` (replacing an older entry), evicting least recently used entries
        until it fits. Returns False (and stores nothing) when the cache is disabled or the state alone is
        larger than the capacity."""
        size = int(state.nbytes)
        with self._lock:
            if size > self.capacity_bytes:
                return False
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._bytes -= previous[1]
            while self._entries and self._bytes + size > self.capacity_bytes:
                _, (_, evicted_size) = self._entries.popitem(last=False)
                self._bytes -= evicted_size
                self._evictions += 1
            self._entries[key] = (state, size)
            self._bytes += size
            self._stores += 1
            return True

    def add_shared(self, count: int = 1) -> None:
        """Count requests served by a state computed earlier in the same batch."""
        with self._lock:
            self._shared += count

    def add_saved(self, tokens: int) -> None:
        """Count backbone tokens not run thanks to a cached or shared state."""
        with self._lock:
            self._tokens_saved += tokens

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> dict[str, int]:
        """A consistent snapshot of the counters: hits, misses, shared, stores, evictions, entries, bytes,
        capacity_bytes, tokens_saved."""
        with self._lock:
            return {
                "hits": self._hits,
                "misses": self._misses,
                "shared": self._shared,
                "stores": self._stores,
                "evictions": self._evictions,
                "entries": len(self._entries),
                "bytes": self._bytes,
                "capacity_bytes": self.capacity_bytes,
                "tokens_saved": self._tokens_saved,
            }
