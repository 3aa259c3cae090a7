"""State affinity: which replica should answer a request, by consistent hashing of its state key.

A request whose state another replica computed is a cold request again, so requests about the same state
(the same token ids up to the end of the state, the same images) should go to the replica that holds it.
`ReplicaRing` maps a state key to an owner over the live replicas by consistent hashing (each replica at
``VIRTUAL_NODES`` points of a 64-bit ring): when a replica joins or leaves, only the keys it owned move.
`choose` applies the policy: the owner, unless its queue is too long, then the less loaded of the owner and
the next replica on the ring (two choices, both stable for the key, so a hot state spreads over at most two
replicas); requests without a cacheable state go to the less loaded of two random replicas.

Pure Python: no Ray here (the Ray Serve router in `clef_runtime.scale.router` calls `choose`), so the policy
is tested in milliseconds.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

__all__ = ["DEFAULT_MAX_OWNER_QUEUE", "VIRTUAL_NODES", "ReplicaRing", "choose"]

VIRTUAL_NODES = 64
#: Requests queued on the owner beyond which the second choice is considered.
DEFAULT_MAX_OWNER_QUEUE = 8

R = TypeVar("R", bound=Hashable)


def _point(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


class ReplicaRing:
    """A consistent-hash ring over replica ids."""

    def __init__(self, replica_ids: Iterable[str], *, virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.replica_ids = tuple(sorted(set(replica_ids)))
        points = []
        for replica in self.replica_ids:
            for number in range(virtual_nodes):
                points.append((_point(f"{replica}#{number}".encode()), replica))
        points.sort()
        self._keys = [point for point, _ in points]
        self._owners = [owner for _, owner in points]

    def owners(self, key: bytes, count: int = 2) -> list[str]:
        """The first ``count`` distinct replicas clockwise from the key's point (the owner first)."""
        if not self._keys:
            return []
        start = bisect.bisect(self._keys, _point(key))
        found: list[str] = []
        for step in range(len(self._keys)):
            owner = self._owners[(start + step) % len(self._keys)]
            if owner not in found:
                found.append(owner)
                if len(found) == count:
                    break
        return found


def choose(
    replicas: Sequence[R],
    replica_id: Callable[[R], str],
    state_key: bytes | None,
    queue_length: Callable[[R], int | None],
    *,
    max_owner_queue: int = DEFAULT_MAX_OWNER_QUEUE,
    rng: random.Random | None = None,
) -> list[R]:
    """The replicas to try for a request, most preferred first (an empty list when there are none).

    With a ``state_key``: the key's owner on the ring of ``replicas``; when the owner's known queue is at
    least ``max_owner_queue``, the less loaded of the owner and the key's second replica comes first.
    Without one: two random replicas, the less loaded first. ``queue_length`` returns a replica's last known
    queue length, or None when unknown (treated as 0).
    """
    if not replicas:
        return []
    by_id = {replica_id(r): r for r in replicas}
    load = {rid: queue_length(r) or 0 for rid, r in by_id.items()}
    if state_key is None:
        picks = (rng or random).sample(sorted(by_id), min(2, len(by_id)))
        picks.sort(key=lambda rid: load[rid])
        return [by_id[rid] for rid in picks]
    ring = ReplicaRing(by_id)
    ranked = ring.owners(state_key, 2)
    if len(ranked) == 2 and load[ranked[0]] >= max_owner_queue and load[ranked[1]] < load[ranked[0]]:
        ranked.reverse()
    return [by_id[rid] for rid in ranked]
