"""The executor under the engine loop, on the tiny model: chunked steps equal one pass, answers come back
as each request completes, cancellation between chunks, requests about one state wait for it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from clef_runtime import Clef
from clef_runtime.engine.loop import EngineLoop
from clef_runtime.engine.policy import StepSettings
from tests.engine.test_state_cache import SCHEMA_A, SCHEMA_B, max_diff, request, variant

TOL = 1e-4


@pytest.fixture(scope="module")
def base() -> Clef:
    return Clef.load("tiny", dtype="fp32", cache_mb=64)


def loop_of(clef: Clef, budget: int) -> EngineLoop:
    return EngineLoop(clef.runner(), StepSettings(max_step_tokens=budget))


def test_small_steps_equal_one_pass(base: Clef) -> None:
    one_pass = variant(base, cache_bytes=0, max_step_tokens=100_000)
    stepped = variant(base, cache_bytes=0, max_step_tokens=64)
    bodies = [request("alpha beta " * n, SCHEMA_A if n % 2 else SCHEMA_B) for n in (10, 150, 400)]
    items = [stepped.prepare(body) for body in bodies]
    expected = one_pass.probabilities_encoded(items)
    assert one_pass.last_timings.steps == 1
    got = stepped.probabilities_encoded(items)
    assert stepped.last_timings.steps > 10  # the long rows went through many 64-token steps
    assert max_diff(got, expected) <= TOL
    assert stepped.last_timings.backbone_tokens == one_pass.last_timings.backbone_tokens


def test_each_answer_returns_when_its_own_work_is_done(base: Clef) -> None:
    clef = variant(base, cache_bytes=0)
    loop = loop_of(clef, budget=128)
    long = loop.submit(clef.prepare(request("a long state " * 300, SCHEMA_A)))
    short = loop.submit(clef.prepare(request("short", SCHEMA_B)))
    finished: list[str] = []
    while not (long.done() and short.done()):
        assert loop._step()
        finished += [n for n, f in (("long", long), ("short", short)) if f.done() and n not in finished]
    assert finished == ["short", "long"]  # overtaken: the short one did not wait for the long one
    assert short.result().timings.steps <= 2  # ~190 tokens in 128-token steps
    assert long.result().timings.steps > 5
    for done in (short, long):
        timings = done.result().timings
        # What the server's trace spans are built from: every step's moments, and the head's share.
        assert len(timings.step_times) == timings.steps
        assert timings.head_s > 0


def test_a_cancelled_request_stops_between_chunks_and_stores_nothing(base: Clef) -> None:
    clef = variant(base, cache_bytes=64 * 1024 * 1024)
    loop = loop_of(clef, budget=64)
    body = request("a state that is never finished " * 40, SCHEMA_A)
    gone = loop.submit(clef.prepare(body))
    assert loop._step() and loop._step()  # two chunks computed: work in flight
    tokens = clef.backbone_tokens
    assert gone.cancel()
    loop.run_until_idle()
    assert clef.backbone_tokens == tokens  # nothing more was computed for it
    assert loop.running == 0
    assert clef.cache_stats()["points"] == 0  # its state was not stored
    again = clef.decide_encoded([clef.prepare(body)])[0]
    assert again.cache.status == "miss"


def test_concurrent_requests_about_one_state_compute_it_once(base: Clef) -> None:
    cold = variant(base, cache_bytes=0)
    for cache_bytes in (64 * 1024 * 1024, 0):
        clef = variant(base, cache_bytes=cache_bytes)
        loop = loop_of(clef, budget=4096)
        state = "the same long document " * 60
        items = [clef.prepare(request(state, schema)) for schema in (SCHEMA_A, SCHEMA_B, SCHEMA_A)]
        futures = [loop.submit(item) for item in items]
        loop.run_until_idle()
        decisions = [future.result() for future in futures]
        assert [d.cache.status for d in decisions] == ["miss", "hit", "hit"]
        state_end = items[0].record.state_end
        assert decisions[1].timings.backbone_tokens == items[1].record.input_tokens - state_end
        assert clef.cache_stats()["shared"] == 2
        expected = cold.probabilities_encoded(items)
        assert max_diff([d.probabilities for d in decisions], expected) <= TOL  # type: ignore[misc]


def test_the_server_loop_and_a_direct_call_interleave_safely(base: Clef) -> None:
    clef = variant(base, cache_bytes=64 * 1024 * 1024)
    loop = loop_of(clef, budget=64)
    loop.start()
    try:
        body: dict[str, Any] = request("interleaved " * 200, SCHEMA_A)
        future = loop.submit(clef.prepare(body))
        time.sleep(0.01)
        direct = clef.decide_many([request("direct", SCHEMA_B)])[0]
        threaded = future.result(60)
    finally:
        loop.close()
    cold = variant(base, cache_bytes=0)
    assert threaded.answers == cold.decide(body)["answers"]
    assert direct["answers"] == cold.decide(request("direct", SCHEMA_B))["answers"]


def test_the_step_budget_is_the_devices_default_unless_given(base: Clef) -> None:
    import torch

    from clef_runtime.engine.clef import default_step_tokens

    assert default_step_tokens(torch.device("cpu")) == 1024
    assert default_step_tokens(torch.device("cuda", 0)) == 16384
    assert base.step_tokens == 1024 and base.step_settings().max_step_tokens == 1024
    given = variant(base, cache_bytes=0, max_step_tokens=96)
    assert given.step_tokens == 96
    given.decide_many([request("a state of some length " * 20, SCHEMA_A)])
    assert given.last_timings.steps > 1  # the budget reached the steps: the request ran in chunks
