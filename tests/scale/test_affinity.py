"""The state-affinity policy (pure: no Ray): consistent hashing, stable fallback, spreading."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

from clef_runtime.scale.affinity import ReplicaRing, choose


def key(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def test_a_key_has_one_owner_and_a_distinct_second_choice() -> None:
    ring = ReplicaRing(["a", "b", "c"])
    for n in range(200):
        owners = ring.owners(key(n), 2)
        assert len(owners) == 2 and owners[0] != owners[1]
        assert ring.owners(key(n), 2) == owners  # stable


def test_keys_spread_over_replicas() -> None:
    ring = ReplicaRing(["a", "b", "c", "d"])
    counts = Counter(ring.owners(key(n), 1)[0] for n in range(4000))
    assert set(counts) == {"a", "b", "c", "d"}
    assert min(counts.values()) > 4000 / 4 * 0.6  # 64 virtual nodes: within 40% of even


def test_a_replica_leaving_moves_only_its_own_keys() -> None:
    before = ReplicaRing(["a", "b", "c"])
    after = ReplicaRing(["a", "c"])
    for n in range(1000):
        owner = before.owners(key(n), 1)[0]
        if owner != "b":
            assert after.owners(key(n), 1)[0] == owner


def test_choose_prefers_the_owner_until_its_queue_is_too_long() -> None:
    replicas = ["r1", "r2", "r3"]
    queues = {"r1": 0, "r2": 0, "r3": 0}
    k = key(7)
    owner, second = ReplicaRing(replicas).owners(k, 2)
    assert choose(replicas, str, k, queues.get)[0] == owner
    queues[owner] = 8
    assert choose(replicas, str, k, queues.get, max_owner_queue=8) == [second, owner]
    queues[second] = 9  # the second is busier still: stay with the owner
    assert choose(replicas, str, k, queues.get, max_owner_queue=8)[0] == owner


def test_requests_without_a_state_go_to_the_less_loaded_of_two() -> None:
    replicas = ["r1", "r2"]
    queues = {"r1": 5, "r2": 1}
    assert choose(replicas, str, None, queues.get, rng=random.Random(0)) == ["r2", "r1"]
    picks = Counter(
        choose(["x", "y", "z"], str, None, lambda r: None, rng=random.Random(n))[0] for n in range(300)
    )
    assert set(picks) == {"x", "y", "z"}


def test_unknown_queue_lengths_count_as_empty_and_no_replica_is_no_choice() -> None:
    assert choose([], str, key(1), lambda r: None) == []
    assert choose(["only"], str, key(1), lambda r: None) == ["only"]
