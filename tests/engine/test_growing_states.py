"""Growing states on the tiny model: a state that extends one already seen resumes from the prefix tree.

Work skipped is proven by counting the tokens that went through the backbone (``last_timings``); answers
are compared with an engine whose cache is off (every row computed from the prompt prefix), within 1e-4 on
every fp32 probability.
"""

from __future__ import annotations

from typing import Any

import pytest

from clef_runtime import Clef
from tests.engine.test_state_cache import SCHEMA_A, SCHEMA_B, max_diff, png_url, request, variant

PREFIX = 36
TOL = 1e-4

MESSAGES = [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}: the invoice {i * 7} was wrong"}
    for i in range(8)
]


@pytest.fixture(scope="module")
def base() -> Clef:
    return Clef.load("tiny", dtype="fp32", cache_mb=64)


@pytest.fixture
def cold(base: Clef) -> Clef:
    return variant(base, cache_bytes=0)


def engine(base: Clef, **options: Any) -> Clef:
    options.setdefault("snapshot_interval", 0)
    return variant(base, cache_bytes=64 * 1024 * 1024, **options)


def resume_point(clef: Clef, prepared: Any) -> int:
    """Where a request resumed, from the tokens the backbone ran (one request per batch)."""
    return prepared.input_tokens - clef.last_timings.backbone_tokens


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (MESSAGES[:5], MESSAGES[:6]),  # a message appended to a message array
        ("The printer on floor 3 is on fi", "The printer on floor 3 is on fire again, call someone"),
        ("log: disk at 91%\nlog: disk at 93", "log: disk at 91%\nlog: disk at 93%\nlog: disk full"),
    ],
    ids=["messages", "string-word", "string-lines"],
)
def test_an_extended_state_resumes_before_the_old_tail(
    base: Clef, cold: Clef, first: Any, second: Any
) -> None:
    clef = engine(base)
    a = clef.prepare(request(first, SCHEMA_A))
    assert a.tail_at is not None and PREFIX < a.tail_at < a.record.state_end
    clef.decide_many([a])
    b = clef.prepare(request(second, SCHEMA_B))
    assert b.record.input_ids[: a.tail_at] == a.record.input_ids[: a.tail_at]  # the extension shares it
    response = clef.decide_many([b])[0]
    # Only the old tail (when the extension re-tokenized it), the new text and the schema ran.
    end = a.record.state_end
    expected = end if b.record.input_ids[:end] == a.record.input_ids[:end] else a.tail_at
    assert resume_point(clef, b) == expected
    assert clef.last_timings.state_partials == 1
    assert response["x_state_cache"] == "partial"
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == expected - PREFIX
    assert max_diff(clef.probabilities_encoded([b]), cold.probabilities_encoded([b])) <= TOL
    assert clef.last_timings.state_hits == 1  # b's own state end is cached now
    clef.state_cache.check()


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 16])
def test_resumed_rows_in_a_batch_equal_cold_singles(base: Clef, cold: Clef, chunk: int | None) -> None:
    clef = engine(base, prefill_chunk=chunk)
    chunked_cold = variant(base, cache_bytes=0, prefill_chunk=chunk)
    a = clef.prepare(request(MESSAGES[:4], SCHEMA_A))
    clef.decide_many([a])
    grown = [
        clef.prepare(request(MESSAGES[:5], SCHEMA_A)),
        clef.prepare(request("an unrelated state", SCHEMA_B)),
        clef.prepare(request(MESSAGES[:7], SCHEMA_B)),
        clef.prepare(request(MESSAGES[:5], SCHEMA_B)),  # the same state as the first: computed once
    ]
    together = clef.probabilities_encoded(grown)
    expected_run = (
        (grown[0].input_tokens - a.tail_at)  # type: ignore[operator]
        + (grown[1].input_tokens - PREFIX)
        + (grown[2].input_tokens - a.tail_at)  # type: ignore[operator]
        + (grown[3].input_tokens - grown[3].record.state_end)
    )
    assert clef.last_timings.backbone_tokens == expected_run
    timings = clef.last_timings
    # Per request: the last one waited for the first's state and reused it whole (a hit).
    assert (timings.state_hits, timings.state_partials, timings.state_misses) == (1, 2, 1)
    singles = [cold.probabilities_encoded([item])[0] for item in grown]
    assert max_diff(together, singles) <= TOL
    assert max_diff(together, [chunked_cold.probabilities_encoded([item])[0] for item in grown]) <= TOL
    clef.state_cache.check()


@pytest.mark.slow
def test_image_rows_resume_after_their_block_and_grow(base: Clef, cold: Clef) -> None:
    clef = variant(base, cache_bytes=64 * 1024 * 1024, snapshot_interval=0)
    image = png_url(64, 48, seed=5)
    a = clef.prepare(request(MESSAGES[:3], SCHEMA_A, images=[image]))
    clef.decide_many([a])
    assert clef.last_timings.backbone_tokens == a.input_tokens - PREFIX
    clef.vision_tower.unload()
    # The same picture, the conversation grown: resumes before the old closing bracket, no tower needed.
    b = clef.prepare(request(MESSAGES[:4], SCHEMA_B, images=[image]))
    hit = clef.probabilities_encoded([b])
    assert resume_point(clef, b) == a.tail_at
    assert not clef.vision_tower.loaded
    assert max_diff(hit, cold.probabilities_encoded([b])) <= TOL
    # The same picture, another state: resumes right after the image block.
    c = clef.prepare(request("what is in this picture?", SCHEMA_A, images=[image]))
    other = clef.probabilities_encoded([c])
    assert resume_point(clef, c) == c.record.state_start > PREFIX
    assert not clef.vision_tower.loaded
    assert max_diff(other, cold.probabilities_encoded([c])) <= TOL
    # Another picture with the same ids: nothing to reuse.
    d = clef.prepare(request(MESSAGES[:4], SCHEMA_B, images=[png_url(64, 48, seed=6)]))
    clef.decide_many([d])
    assert resume_point(clef, d) == PREFIX
    clef.state_cache.check()


def test_a_state_edited_in_the_middle_resumes_at_the_boundary_before_the_edit(base: Clef, cold: Clef) -> None:
    clef = engine(base, snapshot_interval=32)
    words = [f"word{i}" for i in range(60)]
    a = clef.prepare(request(" ".join(words), SCHEMA_A))
    assert a.record.state_end - PREFIX > 100
    clef.decide_many([a])
    edited = clef.prepare(request(" ".join([*words[:40], "CHANGED", *words[41:]]), SCHEMA_A))
    first_difference = next(
        i for i, (x, y) in enumerate(zip(a.record.input_ids, edited.record.input_ids, strict=False)) if x != y
    )
    expected = PREFIX + (first_difference - PREFIX) // 32 * 32
    response = clef.decide_many([edited])[0]
    assert resume_point(clef, edited) == expected > PREFIX
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == expected - PREFIX
    assert max_diff(clef.probabilities_encoded([edited]), cold.probabilities_encoded([edited])) <= TOL


def test_truncation_keeps_the_head_so_a_grown_long_state_still_hits(base: Clef, cold: Clef) -> None:
    clef = engine(base)
    long_state = "entry " * 400
    a = clef.prepare(request(long_state, SCHEMA_A), max_length=300)
    b = clef.prepare(request(long_state + "entry number 401 arrived", SCHEMA_A), max_length=300)
    assert a.truncated_state_tokens > 0 and b.truncated_state_tokens > a.truncated_state_tokens
    assert a.tail_at is None  # a truncated state has no unstable tail: its head is what grows stay
    clef.decide_many([a])
    response = clef.decide_many([b])[0]
    assert response["x_state_cache"] == "hit"
    assert clef.last_timings.backbone_tokens == b.input_tokens - b.record.state_end
    assert max_diff(clef.probabilities_encoded([b]), cold.probabilities_encoded([b])) <= TOL


@pytest.mark.slow
def test_an_agent_history_grows_step_by_step(base: Clef, cold: Clef) -> None:
    clef = engine(base, snapshot_interval=64)
    history: list[dict[str, str]] = []
    previous_tail = None
    for step in range(6):
        history.append({"role": "tool" if step % 2 else "assistant", "content": f"step {step}: ran ls -la"})
        item = clef.prepare(request(list(history), SCHEMA_A if step % 2 else SCHEMA_B))
        response = clef.decide_many([item])[0]
        if previous_tail is None:
            assert response["x_state_cache"] == "miss"
        else:
            assert response["x_state_cache"] == "partial"
            assert resume_point(clef, item) >= previous_tail
        assert max_diff(clef.probabilities_encoded([item]), cold.probabilities_encoded([item])) <= TOL
        previous_tail = item.tail_at
    clef.state_cache.check()
    stats = clef.cache_stats()
    assert stats["partials"] == 5 and stats["misses"] == 1
    # Each node holds its own tokens only: what is stored grows with the longest history (plus each step's
    # few old tail tokens, a short branch), not with the sum of all the histories.
    stored_tokens = sum(len(node.tokens) for node in clef.state_cache._lru)
    assert stored_tokens <= item.record.state_end - PREFIX + 3 * 6
    assert sum(n.segment.nbytes for n in clef.state_cache._lru) == stored_tokens * (
        node_bytes := clef.state_cache._lru.__iter__().__next__().segment.nbytes
        // len(clef.state_cache._lru.__iter__().__next__().tokens)
    )
    assert node_bytes > 0


def test_the_seed_readout_stays_cache_free(base: Clef) -> None:
    seed = variant(base, cache_bytes=64 * 1024 * 1024, prefill_chunk=64, pad_last_chunk=True)
    item = seed.prepare(request(MESSAGES[:3], SCHEMA_A))
    for _ in range(2):
        response = seed.decide_many([item])[0]
        assert response["x_state_cache"] == "miss"
        assert response["usage"]["input_tokens_details"]["cached_tokens"] == 0
        assert seed.last_timings.backbone_tokens == item.input_tokens
    assert seed.cache_stats()["entries"] == 0
