"""Per-caller rate limits: the token bucket itself (a driven clock), then the server's use of it: 429 with
Retry-After and X-RateLimit-* headers, per key name (per client address with auth off), on every decision
route, counted per key name on /metrics and never naming the key."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from clef_runtime.server.auth import KeyChecker, parse_key
from clef_runtime.server.limits import RateLimiter
from clef_runtime.server.settings import ServerSettings, SettingsError
from tests.helpers import ManualClock
from tests.server.conftest import Served
from tests.server.helpers import REQUEST, assert_error_shape, post


def test_a_bucket_allows_its_burst_then_one_request_per_refill() -> None:
    clock = ManualClock(100.0)
    limiter = RateLimiter(2.0, 3, clock=clock)
    taken = [limiter.take("a") for _ in range(4)]
    assert [d.allowed for d in taken] == [True, True, True, False]
    assert [d.remaining for d in taken] == [2, 1, 0, 0]
    refused = taken[-1]
    assert refused.retry_after_s == pytest.approx(0.5)  # one token at 2/s
    assert refused.reset_s == pytest.approx(1.5)  # three tokens to refill
    assert refused.headers() == {
        "X-RateLimit-Limit": "3",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "2",
        "Retry-After": "1",
    }
    clock.now += 0.5
    assert limiter.take("a").allowed and not limiter.take("a").allowed
    assert limiter.take("b").allowed  # another caller has its own bucket
    clock.now += 100
    assert limiter.take("a").remaining == 2  # refilled to the burst, never beyond


def test_full_buckets_are_dropped_when_the_table_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    from clef_runtime.server import limits

    monkeypatch.setattr(limits, "_PRUNE_AT", 3)
    clock = ManualClock(100.0)
    limiter = RateLimiter(10.0, 1, clock=clock)
    for caller in ("a", "b", "c"):
        limiter.take(caller)
    clock.now += 1  # all three refilled: equal to new buckets
    limiter.take("d")
    assert len(limiter) == 1


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (-1.0, 1), (float("inf"), 1), (1.0, 0)])
def test_a_limiter_needs_a_positive_rate_and_burst(rate: float, burst: int) -> None:
    with pytest.raises(ValueError):
        RateLimiter(rate, burst)


def test_keys_are_named_by_name_colon_key_or_by_position() -> None:
    assert parse_key("ops:sk-123", 1).name == "ops" and parse_key("ops:sk-123", 1).secret == "sk-123"
    assert parse_key("plain-key", 2).name == "key-2" and parse_key("plain-key", 2).secret == "plain-key"
    assert parse_key("ci:a:b", 1).secret == "a:b"  # a key with a colon, named
    with pytest.raises(ValueError, match="NAME:KEY"):  # not a valid name: refused, not a bare key
        parse_key("has space:x", 3)
    checker = KeyChecker(["ops:sk-123", "plain-key"])
    assert checker.names == ("ops", "key-2")
    assert checker.name_of("sk-123") == "ops" and checker.name_of("plain-key") == "key-2"
    assert checker.name_of("ops:sk-123") is None and checker.name_of("nope") is None


def test_key_names_must_be_unique_and_limits_positive() -> None:
    with pytest.raises(SettingsError, match="repeated: ops"):
        ServerSettings(model="m", api_keys=("ops:a", "ops:b"))
    with pytest.raises(SettingsError, match="--rate-limit"):
        ServerSettings(model="m", rate_limit=0)
    with pytest.raises(SettingsError, match="--rate-burst"):
        ServerSettings(model="m", rate_limit=1, rate_burst=0)
    assert ServerSettings(model="m", rate_limit=2.5).rate_burst_size == 3


def _metric(text: str, key: str, outcome: str) -> float:
    match = re.search(
        rf'^clef_caller_requests_total{{key="{re.escape(key)}",outcome="{outcome}"}} ([0-9.e+-]+)$',
        text,
        re.MULTILINE,
    )
    return float(match.group(1)) if match else 0.0


def test_each_key_has_its_own_limit_and_the_metrics_name_it_never_the_key(
    serve_fake: Callable[..., Served],
) -> None:
    # A rate so low that no token comes back during the test: the burst is all a key gets.
    served = serve_fake(api_keys=("alice:sk-alice-secret", "sk-bob-secret"), rate_limit=0.001, rate_burst=2)
    client = served.client
    alice = {"Authorization": "Bearer sk-alice-secret"}
    bob = {"X-API-Key": "sk-bob-secret"}
    first, second, third = (post(client, REQUEST, headers=alice) for _ in range(3))
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.headers["x-ratelimit-limit"] == "2" and first.headers["x-ratelimit-remaining"] == "1"
    assert second.headers["x-ratelimit-remaining"] == "0"
    detail = assert_error_shape(third, 429, "rate_limited")
    assert "'alice'" in detail["message"]
    assert int(third.headers["retry-after"]) >= 1 and third.headers["x-ratelimit-remaining"] == "0"
    assert int(third.headers["x-ratelimit-reset"]) > 0
    assert post(client, REQUEST, headers=bob).status_code == 200  # bob's bucket is his own
    assert post(client, REQUEST).status_code == 401  # auth comes first: no key, no bucket
    metrics = client.get("/metrics").text
    assert _metric(metrics, "alice", "admitted") == 2 and _metric(metrics, "alice", "rate_limited") == 1
    assert _metric(metrics, "key-2", "admitted") == 1
    assert 'clef_rejected_requests_total{reason="rate_limited"} 1.0' in metrics
    assert "sk-alice-secret" not in metrics and "sk-bob-secret" not in metrics
    # Three admitted answers, one refusal: the refused request never reached the engine.
    assert len([state for batch in served.engine.batches for state in batch]) == 3


def test_every_decision_route_and_job_submission_counts_against_one_caller(
    serve_fake: Callable[..., Served],
) -> None:
    served = serve_fake(rate_limit=0.001, rate_burst=4)  # auth off: the caller is the client address
    client = served.client
    chat = {
        "model": "clef",
        "messages": [{"role": "user", "content": "I was charged twice."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "object", "properties": {"refund": {"type": "boolean"}}},
            },
        },
    }
    decisions = {
        "state": "I was charged twice.",
        "questions": [{"id": "q", "type": "noul", "prompt": "Refund?"}],
    }
    workers = "/client/v4/accounts/acct/ai/run/@cf/cloudflare/clef-flash"
    answers = [
        post(client, REQUEST),
        post(client, chat, path="/v1/chat/completions"),
        post(client, REQUEST, path=workers),
        client.post(
            "/v1/jobs",
            content=b'{"state": "a", "questions": {"q": {"type": "noul", "instructions": "?"}}}\n',
            headers={"content-type": "application/jsonl"},
        ),
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 202], [a.text for a in answers]
    refused = [post(client, decisions, path="/v1/decisions"), post(client, REQUEST, path=workers)]
    assert [r.status_code for r in refused] == [429, 429]
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert refused[1].json()["errors"][0]["code"] == 3040  # Workers AI's own shape for capacity
    assert client.get("/v1/models").status_code == 200  # info routes are not limited
    metrics = client.get("/metrics").text
    assert (
        _metric(metrics, "anonymous", "admitted") == 4 and _metric(metrics, "anonymous", "rate_limited") == 2
    )


def test_without_a_rate_limit_no_rate_limit_headers_are_sent(client: object) -> None:
    response = post(client, REQUEST)  # type: ignore[arg-type]
    assert response.status_code == 200 and "x-ratelimit-limit" not in response.headers


@pytest.mark.parametrize(
    ("rate", "burst", "words"),
    [
        (1, 1, "1 request/s (burst 1)"),
        (2.5, 3, "2.5 requests/s (burst 3)"),
        (0.5, 1, "0.5 requests/s (burst 1)"),
    ],
)
def test_the_limit_in_words_is_singular_for_one_request_per_second(
    rate: float, burst: int, words: str
) -> None:
    assert RateLimiter(rate, burst, clock=ManualClock()).describe() == words


def test_a_refusal_states_the_limit_in_words(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(rate_limit=0.001, rate_burst=1).client  # no token comes back during the test
    assert post(client, REQUEST).status_code == 200
    detail = assert_error_shape(post(client, REQUEST), 429, "rate_limited")
    assert "over the rate limit of 0.001 requests/s (burst 1) for this client address" in detail["message"]
