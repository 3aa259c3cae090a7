"""The bad-input battery over HTTP: malformed JSON and wrong types at every level (422 naming the field), bad
text and numbers (422 before any engine work, on both decision routes), form bodies, body, count and token
limits at their edges (413 / 422), and the server still answering afterwards."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import zstandard
from devtools.fake_engine import FakeClef, schema_tokens
from fastapi.testclient import TestClient

from clef_runtime.protocol.systemone import parse_request
from tests.server.conftest import Served
from tests.server.helpers import (
    CHOICE,
    MALFORMED,
    NOUL,
    REQUEST,
    SCORE,
    WRONG_TYPES,
    assert_error_shape,
    assert_validation_shape,
    post,
)

ONE_NOUL = {"q": {"type": "noul"}}
PREDICATE = [{"type": "predicate", "instructions": "?"}]

# Raw JSON text: "\ud800" is how a client sends a lone surrogate; 1e400 parses to inf.
CASES: list[tuple[str, str, list[Any]]] = [
    ("/v1/systemone", '{"state": "\\ud800", "questions": {"q": {"type": "noul"}}}', ["body", "state"]),
    (
        "/v1/systemone",
        '{"state": {"a\\ud800": 1}, "questions": {"q": {"type": "noul"}}}',
        ["body", "state", "a\\ud800"],
    ),
    (
        "/v1/systemone",
        '{"model": "\\ud800", "state": "s", "questions": {"q": {"type": "noul"}}}',
        ["body", "model"],
    ),
    (
        "/v1/systemone",
        '{"state": "s", "questions": {"\\udc00": {"type": "noul"}}}',
        ["body", "questions", "\\udc00"],
    ),
    (
        "/v1/systemone",
        '{"state": "s", "questions": {"q": {"type": "choice", "criteria": {"\\ud800": null, "b": null}}}}',
        ["body", "questions", "q", "criteria", "\\ud800"],
    ),
    (
        "/v1/systemone",
        '{"state": {"n": 1e400}, "questions": {"q": {"type": "noul"}}}',
        ["body", "state", "n"],
    ),
    ("/v1/systemone", '{"state": [1, -1e999], "questions": {"q": {"type": "noul"}}}', ["body", "state", 1]),
    (
        "/v1/decisions",
        '{"input": "\\ud800", "questions": [{"type": "predicate", "instructions": "?"}]}',
        ["body", "input"],
    ),
    (
        "/v1/decisions",
        '{"model": "\\ud800", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}]}',
        ["body", "model"],
    ),
    (
        "/v1/decisions",
        '{"input": "x", "questions": [{"type": "predicate", "instructions": "?", "name": "\\ud800"}]}',
        ["body", "questions", 0, "name"],
    ),
    (
        "/v1/decisions",
        '{"input": [{"role": "user", "content": [{"type": "input_json", "data": {"n": 1e400}}]}], '
        '"questions": [{"type": "predicate", "instructions": "?"}]}',
        ["body", "input", 0, "content", 0, "data", "n"],
    ),
]


@pytest.mark.parametrize(("path", "raw", "loc"), CASES, ids=range(len(CASES)))
def test_bad_text_or_numbers_are_422_naming_the_field_before_the_engine_runs(
    serve_fake: Callable[..., Served], path: str, raw: str, loc: list[Any]
) -> None:
    served = serve_fake()
    response = served.client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert [item["loc"] for item in detail] == [loc]
    assert detail[0]["type"] in ("invalid_text", "invalid_json_value")
    assert served.engine.batches == []  # no model work was done
    ok = (
        {"state": "s", "questions": ONE_NOUL}
        if path == "/v1/systemone"
        else {"input": "s", "questions": PREDICATE}
    )
    assert served.client.post(path, json=ok).status_code == 200


def test_a_streamed_body_over_the_limit_says_how_large_it_got(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(max_body_bytes=4096).client
    body = json.dumps({"state": "a" * 10_000, "questions": ONE_NOUL}).encode()
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))  # no Content-Length: chunked
    response = client.post("/v1/systemone", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413
    message = response.json()["detail"]["message"]
    assert "  " not in message
    # What had been read when reading stopped (the test client may merge chunks), and the limit.
    received = re.search(r"reached (\d+) bytes", message)
    assert received is not None and 4096 < int(received.group(1)) <= len(body), message
    assert "limit of 4096 bytes" in message
    declared = client.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert f"{len(body)} bytes" in declared.json()["detail"]["message"]


# ----------------------------------------------------------------------- malformed bodies, limits


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_json_is_422_with_the_validation_shape(client: TestClient, body: bytes) -> None:
    detail = assert_validation_shape(post(client, body))
    assert detail[0]["type"] == "json_invalid"


@pytest.mark.parametrize(("body", "loc"), WRONG_TYPES, ids=range(len(WRONG_TYPES)))
def test_wrong_types_at_every_level_get_422_naming_the_field(
    client: TestClient, body: Any, loc: list[Any]
) -> None:
    detail = assert_validation_shape(client.post("/v1/systemone", content=json.dumps(body)))
    assert any(item["loc"][: len(loc)] == loc for item in detail), detail


def test_form_and_multipart_bodies_are_415(client: TestClient) -> None:
    response = client.post(
        "/v1/systemone", files={"request": ("r.json", json.dumps(REQUEST), "application/json")}
    )
    assert_error_shape(response, 415, "unsupported_media_type")
    assert_error_shape(client.post("/v1/systemone", data={"state": "x"}), 415)


# What `curl -d '{...}'` sends without -H 'Content-Type: application/json'.
CURL_FORM = {"content-type": "application/x-www-form-urlencoded"}
DECISIONS_REQUEST = {
    "input": "Charged twice",
    "questions": [{"type": "predicate", "instructions": "Refund?"}],
}


@pytest.mark.parametrize(("path", "body"), [("/v1/systemone", REQUEST), ("/v1/decisions", DECISIONS_REQUEST)])
def test_a_form_typed_body_that_is_json_is_taken_as_json(client: TestClient, path: str, body: Any) -> None:
    as_curl_sends_it = client.post(path, content=json.dumps(body).encode(), headers=CURL_FORM)
    assert as_curl_sends_it.status_code == 200, as_curl_sends_it.text
    assert as_curl_sends_it.json()["answers"] == post(client, body, path).json()["answers"]


def test_a_form_typed_body_that_is_not_json_is_415_naming_the_header_to_send(client: TestClient) -> None:
    for raw in (b"state=x&questions=y", b'{"state": "x"'):
        response = client.post("/v1/systemone", content=raw, headers=CURL_FORM)
        detail = assert_error_shape(response, 415, "unsupported_media_type")
        assert "-H 'Content-Type: application/json'" in detail["message"], detail
    multipart = client.post(
        "/v1/systemone", files={"request": ("r.json", json.dumps(REQUEST), "application/json")}
    )
    assert "-H 'Content-Type: application/json'" in assert_error_shape(multipart, 415)["message"]


def test_a_missing_content_type_is_tolerated(client: TestClient) -> None:
    response = client.post(
        "/v1/systemone", content=json.dumps(REQUEST).encode(), headers={"content-type": ""}
    )
    assert response.status_code == 200


def _padded(body: dict[str, Any], size: int) -> bytes:
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


@pytest.mark.parametrize(("delta", "status"), [(-1, 200), (0, 200), (1, 413)])
def test_body_limit_at_minus_one_zero_plus_one(
    serve_fake: Callable[..., Served], delta: int, status: int
) -> None:
    client = serve_fake(max_body_bytes=4096).client
    body = _padded(REQUEST, 4096 + delta)
    assert len(body) == 4096 + delta
    response = post(client, body)
    assert response.status_code == status, response.text
    if status == 413:
        assert_error_shape(response, 413, "request_too_large")
    # the same limit applies after decompression
    compressed = zstandard.ZstdCompressor().compress(body)
    assert post(client, compressed, headers={"content-encoding": "zstd"}).status_code == status


def test_a_20_mb_body_is_413_and_the_server_keeps_answering(client: TestClient) -> None:
    huge = b'{"state": "' + b"a" * (20 * 1024 * 1024) + b'", "questions": {"q": {"type": "noul"}}}'
    assert_error_shape(post(client, huge), 413, "request_too_large")
    chunks = (huge[i : i + 65536] for i in range(0, len(huge), 65536))  # no Content-Length: streamed
    response = client.post("/v1/systemone", content=chunks, headers={"content-type": "application/json"})
    assert_error_shape(response, 413, "request_too_large")
    assert post(client, REQUEST).status_code == 200


def _questions_request(count: int) -> dict[str, Any]:
    return {"state": "x", "questions": {f"q{i}": NOUL for i in range(count)}}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (_questions_request(63), 200),
        (_questions_request(64), 200),
        (_questions_request(65), 422),
        ({"state": "x", "questions": {"c": {**CHOICE, "criteria": {"only": None}}}}, 422),
        ({"state": "x", "questions": {"c": {**CHOICE, "criteria": {"a": None, "b": None}}}}, 200),
        (
            {"state": "x", "questions": {"c": {**CHOICE, "criteria": {f"o{i}": None for i in range(254)}}}},
            200,
        ),
        (
            {"state": "x", "questions": {"c": {**CHOICE, "criteria": {f"o{i}": None for i in range(255)}}}},
            200,
        ),
        (
            {"state": "x", "questions": {"c": {**CHOICE, "criteria": {f"o{i}": None for i in range(256)}}}},
            422,
        ),
        ({"state": "x", "questions": {"s": {**SCORE, "criteria": ["one"]}}}, 422),
        ({"state": "x", "questions": {"s": {**SCORE, "criteria": ["a", "b"]}}}, 200),
        ({"state": "x", "questions": {"s": {**SCORE, "criteria": [f"l{i}" for i in range(9)]}}}, 200),
        ({"state": "x", "questions": {"s": {**SCORE, "criteria": [f"l{i}" for i in range(10)]}}}, 200),
        ({"state": "x", "questions": {"s": {**SCORE, "criteria": [f"l{i}" for i in range(11)]}}}, 422),
        ({"state": "x", "questions": {"i" * 255: NOUL}}, 200),
        ({"state": "x", "questions": {"i" * 256: NOUL}}, 200),
        ({"state": "x", "questions": {"i" * 257: NOUL}}, 422),
    ],
    ids=[
        "63q",
        "64q",
        "65q",
        "1opt",
        "2opt",
        "254opt",
        "255opt",
        "256opt",
        "1lvl",
        "2lvl",
        "9lvl",
        "10lvl",
        "11lvl",
        "id255",
        "id256",
        "id257",
    ],
)
def test_count_limits_at_their_edges(client: TestClient, body: dict[str, Any], status: int) -> None:
    response = post(client, body)
    if status == 422:
        assert_validation_shape(response)
    else:
        assert response.status_code == 200, response.text
        assert set(response.json()["answers"]) == set(body["questions"])


def test_unicode_ids_and_option_names_round_trip(client: TestClient) -> None:
    options = {"환불 요청": "돈을 돌려받기", "🙂 기타": None, "e\u0301": "combining", "\u200b": "zero width"}
    body = {
        "state": "배송이 3일째 안 와요 😡",
        "questions": {
            "질문": NOUL,
            "🎯": {**CHOICE, "criteria": options},
            "with space": SCORE,
            "a.b-c_d": NOUL,
        },
    }
    response = post(client, body)
    assert response.status_code == 200
    answers = response.json()["answers"]
    assert list(answers) == list(body["questions"])
    assert list(answers["🎯"]["probabilities"]) == list(options)
    assert "질문".encode() in response.content  # raw UTF-8, not \\u escapes


def _token_limit_request(engine: FakeClef, total_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"state": "", "questions": {"q": NOUL}}
    fixed = schema_tokens(parse_request(body))
    body["state"] = " ".join(["w"] * (total_tokens - fixed))
    return body


@pytest.mark.parametrize(("delta", "truncated"), [(-1, 0), (0, 0), (1, 1)])
def test_token_limit_truncates_by_default(
    serve_fake: Callable[..., Served], delta: int, truncated: int
) -> None:
    served = serve_fake(max_input_tokens=100)
    response = post(served.client, _token_limit_request(served.engine, 100 + delta))
    assert response.status_code == 200
    body = response.json()
    assert body["x_truncated_state_tokens"] == truncated
    assert body["usage"]["input_tokens"] == min(100, 100 + delta)


@pytest.mark.parametrize(("delta", "status"), [(-1, 200), (0, 200), (1, 413)])
def test_token_limit_rejects_with_413_when_told(
    serve_fake: Callable[..., Served], delta: int, status: int
) -> None:
    served = serve_fake(max_input_tokens=100, on_overflow="reject")
    response = post(served.client, _token_limit_request(served.engine, 100 + delta))
    assert response.status_code == status
    if status == 413:
        detail = assert_error_shape(response, 413, "tokens_exceeded")
        assert (detail["input_tokens"], detail["limit"]) == (101, 100)
        assert served.engine.batches == []  # refused before any model work


def test_schema_alone_over_the_limit_is_413(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(max_input_tokens=20)
    body = {"state": "x", "questions": {"q": {**NOUL, "instructions": "word " * 50}}}
    assert_error_shape(post(served.client, body), 413, "tokens_exceeded")


def test_decisions_input_over_the_limit_is_413_too(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(max_input_tokens=30, on_overflow="reject")
    body = {"input": "w " * 100, "questions": [{"type": "predicate", "instructions": "?"}]}
    assert_error_shape(post(served.client, body, "/v1/decisions"), 413, "tokens_exceeded")


def test_the_server_answers_after_the_whole_battery(client: TestClient) -> None:
    for body in MALFORMED:
        post(client, body)
    for body, _ in WRONG_TYPES:
        client.post("/v1/systemone", content=json.dumps(body))
    assert post(client, REQUEST).status_code == 200
    assert client.get("/ready").status_code == 200
