"""Concurrency: the queue limit, batching, failure isolation, deterministic mode, the cache report."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from devtools.fake_engine import FAIL_MARKER, FakeClef, GatedEngine

from clef_runtime.engine.decision import CacheReport, Decision
from clef_runtime.protocol.systemone import SystemOneRequest
from tests.server.conftest import Served, send_behind_a_held_call
from tests.server.helpers import (
    REQUEST,
    assert_error_shape,
    mixed_requests,
    post,
    wait_for,
)


def test_queue_full_is_429_with_retry_after(serve_fake: Callable[..., Served]) -> None:
    engine = FakeClef(delay_s=0.0)
    gate = threading.Event()
    original = engine.decide_encoded

    def held(items: Any) -> Any:
        assert gate.wait(10)
        return original(items)

    engine.decide_encoded = held  # type: ignore[method-assign]
    served = serve_fake(engine, max_queue=1)
    runtime = served.app.state.runtime
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, served.client, {**REQUEST, "state": "first"})
        wait_for(lambda: runtime._running() == 1)
        queued = pool.submit(post, served.client, {**REQUEST, "state": "second"})
        wait_for(lambda: runtime.queue_depth() == 1)
        refused = post(served.client, {**REQUEST, "state": "third"})
        assert_error_shape(refused, 429, "queue_full")
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        gate.set()
        assert running.result(10).status_code == 200
        assert queued.result(10).status_code == 200
    assert 'clef_rejected_requests_total{reason="queue_full"} 1.0' in served.client.get("/metrics").text


def test_64_concurrent_mixed_requests_each_get_their_own_answer(serve_fake: Callable[..., Served]) -> None:
    # The engine holds its first call until the other 63 requests are queued behind it: they are then
    # batched whatever the machine's speed (no dependence on arrival times).
    engine = GatedEngine()
    served = serve_fake(engine)
    bodies = mixed_requests(64)
    sequential = [FakeClef().decide(body) for body in bodies]
    first, rest = send_behind_a_held_call(served, engine, bodies[1:], bodies[0])
    responses = [first, *rest]
    assert [r.status_code for r in responses] == [200] * 64
    for response, expected in zip(responses, sequential, strict=True):
        body = response.json()
        assert body["answers"] == expected["answers"]
        assert body["usage"] == expected["usage"]
    assert max(len(batch) for batch in served.engine.batches) > 1  # batching happened
    assert served.engine.max_concurrent_calls == 1  # the engine never runs two batches at once


def test_a_failing_request_does_not_fail_its_batch_mates(serve_fake: Callable[..., Served]) -> None:
    engine = GatedEngine()
    served = serve_fake(engine)
    bodies = [{**REQUEST, "state": f"ok {i}"} for i in range(4)] + [{**REQUEST, "state": FAIL_MARKER}]
    first, rest = send_behind_a_held_call(served, engine, bodies, {**REQUEST, "state": "held"})
    assert first.status_code == 200
    assert [r.status_code for r in rest] == [200] * 4 + [500]
    # The five were computed as one batch, which failed; then each alone: only the culprit failed.
    assert len(engine.batches[1]) == 5 and all(len(batch) == 1 for batch in engine.batches[2:])


def test_deterministic_mode_gives_identical_bytes_and_runs_requests_alone(
    serve_fake: Callable[..., Served],
) -> None:
    served = serve_fake(FakeClef(delay_s=0.01), deterministic=True)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: post(served.client, REQUEST), range(8)))
    assert len({r.content for r in responses}) == 1
    assert "x_latency_ms" not in responses[0].json()
    assert "x-latency-ms" in responses[0].headers
    assert all(len(batch) == 1 for batch in served.engine.batches)


class CachingEngine(FakeClef):
    """A fake engine whose state cache serves every state it has seen before."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: set[str] = set()

    def _answer(self, request: SystemOneRequest, record: Any, *rest: Any) -> Decision:
        answer = super()._answer(request, record, *rest)
        state = json.dumps(request.state, sort_keys=True)
        if state in self.seen:
            answer = dataclasses.replace(answer, cache=CacheReport("hit", max(1, record.input_tokens // 2)))
        self.seen.add(state)
        return answer


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/decisions"])
def test_the_state_cache_report_reaches_body_and_headers(
    serve_fake: Callable[..., Served], path: str
) -> None:
    served = serve_fake(CachingEngine())
    body = (
        REQUEST
        if path == "/v1/systemone"
        else {
            "input": "Charged twice, refund please.",
            "questions": [{"type": "predicate", "instructions": "Refund?"}],
        }
    )
    first, second = post(served.client, body, path), post(served.client, body, path)
    assert first.status_code == second.status_code == 200, first.text
    assert first.headers["x-clef-state-cache"] == first.json()["x_state_cache"] == "miss"
    assert second.headers["x-clef-state-cache"] == second.json()["x_state_cache"] == "hit"
    cached = second.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached > 0 and second.headers["x-clef-cached-tokens"] == str(cached)
    assert first.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0


def test_deterministic_mode_keeps_the_cache_report_in_headers_only(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(CachingEngine(), deterministic=True)
    first, second = post(served.client, REQUEST), post(served.client, REQUEST)
    assert first.content == second.content  # identical bytes although the second came from the cache
    assert "x_state_cache" not in second.json()
    assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert (first.headers["x-clef-state-cache"], second.headers["x-clef-state-cache"]) == ("miss", "hit")
    assert int(second.headers["x-clef-cached-tokens"]) > 0


def test_every_answer_says_how_its_time_went(serve_fake: Callable[..., Served]) -> None:
    engine = GatedEngine()
    served = serve_fake(engine)
    runtime = served.app.state.runtime
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, served.client, REQUEST)
        assert engine.first_entered.wait(10)
        queued = pool.submit(post, served.client, {**REQUEST, "state": "second"})
        wait_for(lambda: runtime.queue_depth() == 1)
        time.sleep(0.2)  # the second request waits at least this long for its first step
        engine.gate.set()
        responses = [first.result(10), queued.result(10)]
    for response in responses:
        headers = response.headers
        assert int(headers["x-clef-steps"]) == 1  # the fake engine answers a request in one step
        assert int(headers["x-compute-tokens"]) == response.json()["usage"]["input_tokens"]
        assert (
            int(headers["x-total-time"])
            >= int(headers["x-queue-time"]) + int(headers["x-inference-time"]) - 1
        )
    assert int(responses[0].headers["x-inference-time"]) >= 200  # held by the gate while computing
    assert int(responses[1].headers["x-queue-time"]) >= 200
    text = served.client.get("/metrics").text
    assert "clef_queue_wait_seconds_count 2.0" in text and "clef_request_steps_count 2.0" in text


def test_a_request_past_the_queue_timeout_is_503_with_retry_after_and_never_computed(
    serve_fake: Callable[..., Served],
) -> None:
    engine = GatedEngine()
    served = serve_fake(engine, queue_timeout_ms=100)
    holder = {"state": "holder", "questions": {"q": {"type": "noul", "instructions": "Refund?"}}}
    late = {"state": "late", "questions": {"q": {"type": "noul", "instructions": "Refund?"}}}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(served.client.post, "/v1/systemone", json=holder)
        assert engine.first_entered.wait(10)
        refused = post(served.client, late)  # answered while the engine is still held on "holder"
        assert not first.done()
        engine.gate.set()
        assert first.result(30).status_code == 200
    detail = assert_error_shape(refused, 503, "queue_timeout")
    assert "--queue-timeout-ms" in detail["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert post(served.client, REQUEST).status_code == 200
    states = [state for batch in engine.batches for state in batch]
    assert "late" not in states and "holder" in states
    metrics = served.client.get("/metrics").text
    assert 'clef_rejected_requests_total{reason="queue_timeout"} 1.0' in metrics
