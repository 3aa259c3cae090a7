"""The state cache: keys, the byte-bounded LRU, and the engine using it on the tiny model.

Work skipped is proven by counting the tokens that really went through the backbone
(``Clef.last_timings.backbone_tokens`` / ``Clef.backbone_tokens``), not only by comparing numbers. Cold
references come from an engine with the cache disabled, and from one full backbone pass without any cache.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from clef_runtime import Clef
from clef_runtime.engine.clef import PreparedRequest
from clef_runtime.engine.state_cache import TEXT_ROOT, Match, StateCache, image_digest, state_key
from clef_runtime.vision.tower import VisionTower
from tests.helpers import png_data_url as png_url

PREFIX = 36

# ------------------------------------------------------------------------------------------- helpers


def variant(base: Clef, *, cache_bytes: int, **options: Any) -> Clef:
    """Another engine on the same loaded weights (own state cache, own vision tower)."""
    tower = VisionTower(base.path, device=base.backbone.device, dtype=base.backbone.dtype)
    model = dataclasses.replace(base.model, vision_tower=tower)
    return Clef(model, base.options.replace(cache_mb=cache_bytes / 2**20, **options))


def flat(probs: list[list[list[float]]]) -> list[float]:
    return [p for item in probs for question in item for p in question]


def max_diff(a: list[list[list[float]]], b: list[list[list[float]]]) -> float:
    x, y = flat(a), flat(b)
    assert len(x) == len(y)
    return max(abs(p - q) for p, q in zip(x, y, strict=True))


STATE = {"ticket": "The printer on floor 3 is on fire again. " * 12, "priority": "unknown"}
SCHEMA_A = {
    "urgent": {"type": "noul", "instructions": "Is this urgent?"},
    "team": {"type": "choice", "criteria": {"facilities": "building", "it": "computers", "hr": None}},
}
SCHEMA_B = {
    "severity": {"type": "score", "criteria": ["none", "low", "high", "critical"]},
    "spam": {"type": "noul"},
}


def request(state: Any, questions: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"state": state, "questions": questions, **extra}


@pytest.fixture(scope="module")
def base() -> Clef:
    return Clef.load("tiny", dtype="fp32", cache_mb=64)


@pytest.fixture
def clef(base: Clef) -> Clef:
    """A fresh engine with an empty 64 MiB cache on the shared weights."""
    return variant(base, cache_bytes=64 * 1024 * 1024)


@pytest.fixture
def cold(base: Clef) -> Clef:
    """The same weights with the state cache disabled."""
    return variant(base, cache_bytes=0)


# ---------------------------------------------------------------------------------------------- keys


def test_state_key_depends_on_every_id_and_image() -> None:
    ids = list(range(100, 160))
    key = state_key(ids)
    assert len(key) == 32 and key == state_key(tuple(ids))
    assert state_key(ids[:-1]) != key
    assert state_key([*ids[:-1], 7]) != key
    assert state_key(ids, [b"a" * 32]) != key
    assert state_key(ids, [b"a" * 32]) != state_key(ids, [b"b" * 32])
    assert state_key(ids, [b"a" * 32, b"b" * 32]) != state_key(ids, [b"b" * 32, b"a" * 32])


def test_image_digest_reads_pixels_and_grid() -> None:
    pixels = torch.linspace(-1, 1, 16 * 1536).reshape(16, 1536)
    digest = image_digest(pixels, (1, 4, 4))
    assert digest == image_digest(pixels.clone(), (1, 4, 4))
    changed = pixels.clone()
    changed[7, 100] += 1e-3
    assert image_digest(changed, (1, 4, 4)) != digest
    assert image_digest(pixels, (1, 2, 8)) != digest  # same bytes, other grid


# ---------------------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class Seg:
    """A stand-in segment: the ids it covers, 10 bytes a token."""

    ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return 10 * len(self.ids)

    def slice(self, begin: int, end: int) -> Seg:
        assert 0 <= begin < end <= len(self.ids)
        return Seg(self.ids[begin:end])


@dataclass(frozen=True)
class Pt:
    """A stand-in point: the ids before it, 5 bytes."""

    before: tuple[int, ...]
    nbytes: int = 5


def store(
    cache: StateCache, ids: tuple[int, ...], points: list[int], start: int = 0, root: bytes = b""
) -> int:
    return cache.insert(
        root,
        ids,
        start=start,
        segment=Seg(ids[start : max(points)]),
        points={p: Pt(ids[:p]) for p in points},
    )


def restored(match: Match) -> tuple[int, ...]:
    """The ids a match's segments cover, checked against its point."""
    ids = tuple(i for segment in match.segments for i in segment.ids)  # type: ignore[attr-defined]
    assert len(ids) == match.length
    if match.point is not None:
        assert match.point.before == ids  # type: ignore[attr-defined]
    return ids


def absent(match: Match) -> bool:
    return not match.root and match.length == 0 and not match.segments and match.point is None


def test_lookup_resumes_at_the_deepest_point_on_the_path() -> None:
    cache = StateCache(10_000)
    ids = tuple(range(100, 140))
    assert store(cache, ids, [16, 32, 40]) == 3
    cache.check()
    assert cache.lookup(TEXT_ROOT, ids).length == 40
    grown = (*ids[:38], 7, 8, 9, 10)  # diverges inside the last node: resumes at the point before it
    match = cache.lookup(TEXT_ROOT, grown)
    assert match.length == 32 and restored(match) == ids[:32]
    assert cache.lookup(TEXT_ROOT, (1, 2, 3)).length == 0
    assert cache.lookup(TEXT_ROOT, ids[:20]).length == 16  # a prefix of a cached state
    assert absent(cache.lookup(b"other root", ids))


def test_a_point_inside_a_node_splits_it_and_memory_stays_linear() -> None:
    cache = StateCache(10_000)
    ids = tuple(range(200, 260))
    store(cache, ids, [60])
    assert cache.stats()["bytes"] == 60 * 10 + 5
    # A branch diverging at 45, computed from the cached point at... nothing: the run starts at 0 again.
    other = (*ids[:45], *range(900, 915))
    assert store(cache, other, [30, 60]) == 2  # the old node is split at 30 (new point) and at 45 (branch)
    cache.check()
    stats = cache.stats()
    # Each token's K/V and rows are held once: 60 shared or own ids + 15 new ones, and three points.
    assert stats["bytes"] == (60 + 15) * 10 + 3 * 5 and stats["points"] == 3
    assert restored(cache.lookup(TEXT_ROOT, other)) == other
    assert restored(cache.lookup(TEXT_ROOT, ids)) == ids
    assert cache.lookup(TEXT_ROOT, (*ids[:50], 1)).length == 30


def test_a_growing_state_stores_only_its_new_tokens() -> None:
    cache = StateCache(100_000)
    history: tuple[int, ...] = ()
    resumed = []
    for step in range(10):
        history = (*history, *range(1000 + 10 * step, 1010 + 10 * step))
        match = cache.lookup(TEXT_ROOT, history)
        resumed.append(match.length)
        store(cache, history, [len(history)], start=match.length)
        cache.check()
    assert resumed == [10 * step for step in range(10)]
    assert cache.stats()["bytes"] == len(history) * 10 + 10 * 5  # linear, not quadratic


def test_eviction_takes_leaves_first_and_keeps_every_point_restorable() -> None:
    cache = StateCache(1000)
    base = tuple(range(40))
    store(cache, base, [20, 40])  # 400 + 2 x 5
    store(cache, (*base[:20], *range(500, 520)), [40], start=20)  # a branch below the point at 20
    assert cache.stats()["bytes"] == 615
    cache.lookup(TEXT_ROOT, base)  # the base path is now the most recent
    store(cache, tuple(range(3000, 3040)), [40])  # 405 more bytes: the branch leaf (least recent) goes
    cache.check()
    stats = cache.stats()
    assert stats["evictions"] == 1 and stats["bytes"] <= 1000
    assert cache.lookup(TEXT_ROOT, (*base[:20], *range(500, 520))).length == 20
    assert cache.lookup(TEXT_ROOT, base).length == 40
    # Everything else is needed less than a new state that does not fit beside it: interior nodes are
    # never evicted before the leaves below them.
    store(cache, tuple(range(5000, 5080)), [80])
    cache.check()
    assert cache.lookup(TEXT_ROOT, tuple(range(5000, 5080))).length == 80
    assert not store(cache, tuple(range(101)), [101])  # larger than the whole budget: nothing stored
    cache.check()


def test_image_roots_are_created_with_their_block_and_evicted_when_unused() -> None:
    cache = StateCache(2000)
    root = b"r" * 32
    block = Seg((248053, 248056, 248056, 248054))
    ids = tuple(range(10, 30))
    assert absent(cache.lookup(root, ids))
    assert store(cache, ids, [20], root=root) == 0  # no root, no root part: nothing
    cache.insert(root, ids, start=0, segment=Seg(ids), points={20: Pt(ids)}, root_part=(block, Pt(())))
    cache.check()
    match = cache.lookup(root, ids)
    assert match.root and match.length == 20 and match.segments[0] == block
    only_block = cache.lookup(root, (1, 2))
    assert only_block.root and only_block.length == 0 and only_block.point == Pt(())
    store(cache, tuple(range(500, 696)), [196])  # 1965 bytes: the image tree goes, leaf then root
    cache.check()
    assert absent(cache.lookup(root, ids))


def test_disabled_cache_stores_nothing() -> None:
    cache = StateCache(0)
    assert not cache.enabled
    assert store(cache, (1, 2, 3), [3]) == 0
    assert len(cache) == 0 and cache.lookup(TEXT_ROOT, (1, 2, 3)).length == 0
    with pytest.raises(ValueError):
        StateCache(-1)


def test_tree_is_thread_safe() -> None:
    cache = StateCache(3000)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(400):
                ids = tuple(int(i) for i in rng.integers(0, 4, int(rng.integers(2, 30))))
                match = cache.lookup(TEXT_ROOT, ids)
                restored(match)
                if rng.random() < 0.5 and match.length < len(ids):
                    store(
                        cache,
                        ids,
                        sorted({len(ids), int(rng.integers(match.length + 1, len(ids) + 1))}),
                        start=match.length,
                    )
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    cache.check()
    assert cache.stats()["bytes"] <= 3000


# ---------------------------------------------------------------------------------- engine: hits


def test_hit_equals_cold_and_runs_only_schema_and_suffix(clef: Clef, cold: Clef) -> None:
    first = clef.prepare(request(STATE, SCHEMA_A))
    clef.probabilities_encoded([first])
    assert clef.last_timings.backbone_tokens == first.input_tokens - PREFIX  # the prefix is always cached
    assert clef.last_timings.state_misses == 1

    second = clef.prepare(request(STATE, SCHEMA_B))
    assert second.state_key == first.state_key
    before = clef.backbone_tokens
    hit = clef.probabilities_encoded([second])
    ran = clef.backbone_tokens - before
    assert clef.last_timings.state_hits == 1
    assert ran == second.input_tokens - second.record.state_end  # schema + suffix only

    reference = cold.probabilities_encoded([second])
    assert cold.last_timings.backbone_tokens == second.input_tokens - PREFIX
    assert max_diff(hit, reference) <= 1e-4
    stats = clef.cache_stats()
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["partials"] == 0
    assert stats["tokens_saved"] == PREFIX + second.record.state_end
    assert stats["reused_tokens"] == second.record.state_end - PREFIX


@pytest.mark.slow
def test_hit_rows_equal_one_full_pass(clef: Clef) -> None:
    clef.decide(request(STATE, SCHEMA_A))
    prepared = clef.prepare(request(STATE, SCHEMA_B))
    (rows,) = clef.hidden_rows([prepared])
    assert clef.last_timings.state_hits == 1
    # No cache at all: one forward over the whole row.
    full = clef.backbone.hidden_states(prepared.record.input_ids)
    assert (rows - full).abs().max().item() <= 1e-4


def _tree_tensors(clef: Clef) -> list[torch.Tensor]:
    tensors = []
    for node in clef.state_cache._lru:
        parts = [node.segment, node.point]
        for part in parts:
            for layer in (getattr(part, "kv", None) or getattr(part, "linear", None) or ()) if part else ():
                if layer is not None:
                    tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        if node.segment is not None:
            tensors.append(node.segment.hidden)
    return tensors


def test_cached_state_is_not_modified_by_its_use(clef: Clef) -> None:
    prepared = clef.prepare(request(STATE, SCHEMA_A))
    clef.decide_many([prepared])
    before = [t.clone() for t in _tree_tensors(clef)]
    assert before
    clef.decide_many([clef.prepare(request(STATE, SCHEMA_B)), clef.prepare(request(STATE, SCHEMA_A))])
    assert clef.last_timings.state_hits == 2  # both requests, one cached state
    after = _tree_tensors(clef)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_different_truncation_misses(clef: Clef) -> None:
    long_state = "word " * 500
    small_schema = {"q": {"type": "noul"}}
    big_schema = {"q": {"type": "choice", "criteria": {f"option {i}": f"meaning {i}" for i in range(8)}}}
    first = clef.prepare(request(long_state, small_schema), max_length=400)
    second = clef.prepare(request(long_state, big_schema), max_length=400)
    assert first.truncated_state_tokens > 0 and second.truncated_state_tokens > first.truncated_state_tokens
    assert first.state_key != second.state_key
    clef.decide_many([first])
    clef.decide_many([second])
    assert clef.last_timings.state_misses == 1
    assert clef.last_timings.backbone_tokens == second.input_tokens - PREFIX


def test_a_different_image_with_the_same_ids_misses(clef: Clef, cold: Clef) -> None:
    one = clef.prepare(request("look", SCHEMA_A, images=[png_url(64, 64, seed=1)]))
    other = clef.prepare(request("look", SCHEMA_A, images=[png_url(64, 64, seed=2)]))
    assert one.record.input_ids == other.record.input_ids
    assert one.state_key != other.state_key
    first = clef.probabilities_encoded([one])
    second = clef.probabilities_encoded([other])
    assert clef.last_timings.state_misses == 1
    assert clef.last_timings.backbone_tokens == other.input_tokens - PREFIX
    assert max_diff(first, second) > 1e-4  # the picture changed the answer
    assert max_diff(second, cold.probabilities_encoded([other])) <= 1e-4


@pytest.mark.slow
def test_image_hit_needs_no_vision_tower(clef: Clef, cold: Clef) -> None:
    image = png_url(80, 48, seed=3)
    clef.decide(request("look at this", SCHEMA_A, images=[image]))
    assert clef.vision_tower.loaded
    clef.vision_tower.unload()
    prepared = clef.prepare(request("look at this", SCHEMA_B, images=[image]))
    hit = clef.probabilities_encoded([prepared])
    assert clef.last_timings.state_hits == 1
    assert clef.last_timings.backbone_tokens == prepared.input_tokens - prepared.record.state_end
    assert not clef.vision_tower.loaded  # the state came from the cache: the tower was not needed
    assert max_diff(hit, cold.probabilities_encoded([prepared])) <= 1e-4


@pytest.mark.slow
def test_eviction_under_a_tiny_budget(base: Clef) -> None:
    probe = variant(base, cache_bytes=1 << 30)
    states = [f"state number {i} " * 20 for i in range(3)]
    prepared = [probe.prepare(request(s, SCHEMA_A)) for s in states]
    probe.decide_many(prepared[:1])
    size = probe.cache_stats()["bytes"]
    small = variant(base, cache_bytes=int(size * 1.5))  # room for one of these states, not two
    for item in prepared:
        small.decide_many([item])
    stats = small.cache_stats()
    assert stats["evictions"] >= 2 and stats["bytes"] <= stats["capacity_bytes"]
    small.state_cache.check()
    small.decide_many(prepared[:1])  # evicted: cold again
    assert small.last_timings.state_misses == 1
    assert small.last_timings.backbone_tokens == prepared[0].input_tokens - PREFIX
    small.decide_many(prepared[:1])  # and now cached
    assert small.last_timings.state_hits == 1


@pytest.mark.slow
@pytest.mark.parametrize("cache_bytes", [64 * 1024 * 1024, 0])
def test_a_state_shared_inside_a_batch_is_computed_once(base: Clef, cold: Clef, cache_bytes: int) -> None:
    engine = variant(base, cache_bytes=cache_bytes)
    a = engine.prepare(request(STATE, SCHEMA_A))
    b = engine.prepare(request(STATE, SCHEMA_B))
    other = engine.prepare(request("something else entirely", SCHEMA_B))
    together = engine.probabilities_encoded([a, other, b])
    assert engine.last_timings.state_misses == 2  # two distinct states: b waited for a's, then reused it
    assert engine.last_timings.state_hits == 1
    expected_tokens = (a.input_tokens - PREFIX) + (other.input_tokens - PREFIX)
    expected_tokens += b.input_tokens - b.record.state_end  # b ran only its schema + suffix
    assert engine.last_timings.backbone_tokens == expected_tokens
    assert engine.cache_stats()["shared"] == 1
    assert engine.cache_stats()["points"] >= (2 if cache_bytes else 0)
    assert engine.cache_stats()["entries"] or not cache_bytes
    singles = [cold.probabilities_encoded([item])[0] for item in (a, other, b)]
    assert max_diff(together, singles) <= 1e-4


def test_disabled_cache_is_still_correct(cold: Clef) -> None:
    prepared = cold.prepare(request(STATE, SCHEMA_B))
    for _ in range(2):
        rows = cold.hidden_rows([prepared])[0]
        assert cold.last_timings.backbone_tokens == prepared.input_tokens - PREFIX
        assert cold.last_timings.state_hits == 0
    full = cold.backbone.hidden_states(prepared.record.input_ids)
    assert (rows - full).abs().max().item() <= 1e-4
    assert cold.cache_stats()["entries"] == 0 and cold.cache_stats()["bytes"] == 0


def test_chunked_prefill_with_the_cache(base: Clef, cold: Clef) -> None:
    chunked = variant(base, cache_bytes=64 * 1024 * 1024, prefill_chunk=16)
    a = chunked.prepare(request(STATE, SCHEMA_A))
    b = chunked.prepare(request(STATE, SCHEMA_B))
    chunked.decide_many([a])
    hit = chunked.probabilities_encoded([b])
    assert chunked.last_timings.backbone_tokens == b.input_tokens - b.record.state_end
    assert max_diff(hit, cold.probabilities_encoded([b])) <= 1e-4


def test_tuple_items_use_the_cache_too(clef: Clef) -> None:
    parsed = clef.parse(request(STATE, SCHEMA_A))
    record = clef.encode(parsed)
    clef.decide_many([(parsed, record)])
    clef.decide_many([(parsed, record)])
    assert clef.last_timings.state_hits == 1
    assert clef.last_timings.backbone_tokens == record.input_tokens - record.state_end
    assert isinstance(clef.prepare(parsed), PreparedRequest)


def test_concurrent_use_from_threads(clef: Clef, cold: Clef) -> None:
    bodies = [request(f"shared state {i % 3} " * 15, SCHEMA_A if i % 2 else SCHEMA_B) for i in range(12)]
    expected = [cold.probabilities_encoded([cold.prepare(body)])[0] for body in bodies]
    results: dict[int, list[list[float]]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(offset: int) -> None:
        try:
            barrier.wait()
            for index in range(offset, len(bodies), 4):
                results[index] = clef.probabilities_encoded([clef.prepare(bodies[index])])[0]
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert max_diff([results[i] for i in range(len(bodies))], expected) <= 1e-4
    stats = clef.cache_stats()
    assert stats["misses"] == 3 and stats["hits"] == len(bodies) - 3  # three distinct states
