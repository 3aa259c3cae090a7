"""Determinism on the tiny model at CI size (tests/reliability/determinism.py; the 200-request figures
are in RELIABILITY.md): batched vs alone and cache hit vs cold agree to float rounding, and a request
answered alone twice gives identical bytes. Server-level ``--deterministic`` bytes are tested in
tests/server/test_concurrency.py and tests/server/routes/test_conformance.py."""

from __future__ import annotations

import pytest

from clef_runtime.engine.clef import Clef
from tests.reliability.determinism import measure, varied_requests


@pytest.mark.slow
def test_batched_cached_and_repeated_answers_agree_on_the_tiny_model() -> None:
    engine = Clef.load("tiny", dtype="fp32", cache_mb=64)
    report = measure(engine, varied_requests(10, seed=1), seed=1)
    assert report.requests == 10 and report.batches >= 2
    assert report.cache_hits >= 10
    assert report.repeat_bytes_identical
    assert report.max_batched_vs_alone <= 1e-5
    assert report.max_cache_hit_vs_cold <= 1e-5
    # After rounding to 4 decimals, at most one unit of the last place.
    assert report.max_batched_vs_alone_wire <= 1e-4 + 1e-9
    assert report.max_cache_hit_vs_cold_wire <= 1e-4 + 1e-9


def test_varied_requests_are_varied_and_reproducible() -> None:
    bodies = varied_requests(50, seed=3)
    assert bodies == varied_requests(50, seed=3)
    types = {q["type"] for body in bodies for q in body["questions"].values()}
    assert types == {"noul", "choice", "score"}
    assert {type(body["state"]) for body in bodies} == {str, dict}
    assert len({len(str(body["state"])) for body in bodies}) > 40
