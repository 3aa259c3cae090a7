"""The HTTP API against the fake engine: shapes, wire rules, auth, errors, limits, metrics, readiness."""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import zstandard
from fastapi.testclient import TestClient

from clef_runtime.protocol.systemone import SystemOneRequest, parse_request
from clef_runtime.server.app import create_app
from clef_runtime.server.settings import ServerSettings
from tests.server.conftest import Served, send_behind_a_held_call
from tests.server.fake_engine import FAIL_MARKER, FakeClef, GatedEngine, schema_tokens

NOUL = {"type": "noul", "instructions": "Is a refund requested?"}
CHOICE = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "charges", "tech": None}}
SCORE = {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]}
REQUEST = {
    "model": "jev-latest",
    "state": {"ticket": "Charged twice, please refund today."},
    "questions": {"refund": NOUL, "team": CHOICE, "urgency": SCORE},
}


def post(client: TestClient, body: Any, path: str = "/v1/systemone", **kwargs: Any) -> Any:
    if isinstance(body, bytes):
        return client.post(
            path,
            content=body,
            headers={"content-type": "application/json", **kwargs.pop("headers", {})},
            **kwargs,
        )
    return client.post(path, json=body, **kwargs)


def assert_validation_shape(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail
    for item in detail:
        assert set(item) == {"loc", "msg", "type"}
        assert item["loc"][0] == "body"
        assert isinstance(item["msg"], str) and isinstance(item["type"], str)
    return detail


def assert_error_shape(response: Any, status: int, error_type: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail["error_type"], str) and isinstance(detail["message"], str)
    if error_type is not None:
        assert detail["error_type"] == error_type
    return detail


# ------------------------------------------------------------------------------------------- shapes


def test_systemone_answers_with_the_engine_response_plus_x_fields(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake()
    response = post(served.client, REQUEST)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    expected = FakeClef().decide(REQUEST)
    assert body == {**expected, "x_truncated_state_tokens": 0, "x_latency_ms": body["x_latency_ms"]}
    assert set(body) == {
        "model",
        "answers",
        "usage",
        "x_truncated_state_tokens",
        "x_latency_ms",
        "x_state_cache",
    }
    assert body["x_truncated_state_tokens"] == 0
    assert response.headers["x-clef-state-cache"] == body["x_state_cache"] == "miss"
    assert response.headers["x-clef-cached-tokens"] == "0"
    assert isinstance(body["x_latency_ms"], float) and body["x_latency_ms"] >= 0
    assert list(body["answers"]) == ["refund", "team", "urgency"]


def test_every_extra_top_level_field_is_x_prefixed(client: TestClient) -> None:
    body = post(client, REQUEST).json()
    assert all(key in ("model", "answers", "usage") or key.startswith("x_") for key in body)


def test_answer_fields_per_type(client: TestClient) -> None:
    answers = post(client, REQUEST).json()["answers"]
    assert set(answers["refund"]) == {"type", "noul"}
    assert set(answers["team"]) == {"type", "choice", "confidence", "probabilities"}
    assert list(answers["team"]["probabilities"]) == ["billing", "tech"]
    assert set(answers["urgency"]) == {"type", "score", "confidence", "legend", "probabilities"}
    assert answers["urgency"]["legend"] == {"0": "can wait", "1": "this week", "2": "today"}


def test_state_of_every_json_kind_is_accepted(client: TestClient) -> None:
    for state in ("text", {"a": [1, {"b": None}]}, ["x", 2, {"y": True}], ""):
        assert post(client, {**REQUEST, "state": state}).status_code == 200


def test_decisions_route_maps_onto_the_engine(client: TestClient) -> None:
    body = {
        "model": "gpt-6-luna",
        "input": "Charged twice, please refund today.",
        "questions": [
            {"type": "predicate", "instructions": "Refund requested?", "name": "refund"},
            {
                "type": "choice",
                "instructions": "Which team?",
                "choices": [{"value": "billing"}, {"value": False}],
            },
            {"type": "score", "instructions": "Urgency?", "levels": [{"label": "low"}, {"label": "high"}]},
        ],
    }
    response = post(client, body, "/v1/decisions")
    assert response.status_code == 200, response.text
    out = response.json()
    assert [a["type"] for a in out["answers"]] == ["predicate", "choice", "score"]
    assert [a["name"] for a in out["answers"]] == ["refund", None, None]
    choice = out["answers"][1]
    assert [p["value"] for p in choice["probabilities"]] == ["billing", False]
    assert choice["choice"] in ("billing", False)
    assert out["usage"]["total_tokens"] == out["usage"]["input_tokens"] > 0
    assert set(out) == {
        "model",
        "answers",
        "usage",
        "x_truncated_state_tokens",
        "x_latency_ms",
        "x_state_cache",
    }
    assert response.headers["x-clef-state-cache"] == out["x_state_cache"] == "miss"
    # The same engine answers the mapped System One request identically.
    systemone = {
        "model": "gpt-6-luna",
        "state": body["input"],
        "questions": {
            "refund": {"type": "noul", "instructions": "Refund requested?"},
            "q2": {
                "type": "choice",
                "instructions": "Which team?",
                "criteria": {"billing": None, "false": None},
            },
            "q3": {"type": "score", "instructions": "Urgency?", "criteria": ["low", "high"]},
        },
    }
    direct = FakeClef().decide(systemone)["answers"]
    assert out["answers"][0]["probability"] == direct["refund"]["noul"]
    assert [p["probability"] for p in choice["probabilities"]] == list(direct["q2"]["probabilities"].values())


def test_decisions_validation_errors_point_into_the_decisions_body(client: TestClient) -> None:
    body = {"input": "x", "questions": [{"type": "choice", "instructions": "?", "choices": [{"value": "a"}]}]}
    detail = assert_validation_shape(post(client, body, "/v1/decisions"))
    assert detail[0]["loc"] == ["body", "questions", 0, "choices"]


def test_models_lists_the_engine_in_jev_and_openai_shapes(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["models"] == [
        {
            "name": "fake-clef",
            "description": "Fake engine for API tests (untrained: answers are pseudo-random).",
            "release_date": "1970-01-01",
        }
    ]
    assert body["data"][0]["id"] == "fake-clef" and body["data"][0]["object"] == "model"
    assert "untrained" in body["models"][0]["description"]


def test_health_ready_metrics_and_docs(client: TestClient) -> None:
    assert client.get("/health").json()["state"] == "ready"
    assert client.get("/ready").json() == {"status": "ready", "model": "fake-clef"}
    assert client.head("/health").status_code == client.head("/ready").status_code == 200  # load balancers
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    assert {"/v1/systemone", "/v1/decisions", "/v1/models", "/health", "/ready", "/metrics"} <= set(
        spec["paths"]
    )
    ref = spec["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "$ref"
    ]
    assert ref.rsplit("/", 1)[1] in spec["components"]["schemas"]
    for schema in spec["components"]["schemas"].values():  # every reference resolves
        for ref in _refs(schema):
            assert ref.rsplit("/", 1)[1] in spec["components"]["schemas"], ref


def test_the_published_schema_describes_images(client: TestClient) -> None:
    # The images are taken out of the body by hand; the schema still has to say they are accepted (and
    # schema fuzzers then send them).
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    properties = schemas["SystemOneRequest"]["properties"]
    images = next(member for member in properties["images"]["anyOf"] if member.get("type") == "array")
    assert images["maxItems"] == 4
    assert {"$ref": "#/components/schemas/Base64Image"} in images["items"]["anyOf"]
    state_array = next(member for member in properties["state"]["anyOf"] if member.get("type") == "array")
    assert {"$ref": "#/components/schemas/StateImageUrlPart"} in state_array["items"]["anyOf"]
    assert {"$ref": "#/components/schemas/StateInputImagePart"} in state_array["items"]["anyOf"]


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [node["$ref"]] if "$ref" in node else [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_metrics_count_requests_tokens_and_batches(client: TestClient) -> None:
    post(client, REQUEST)
    post(client, b"{")
    text = client.get("/metrics").text
    assert 'clef_requests_total{method="POST",route="/v1/systemone",status="200"} 1.0' in text
    assert 'clef_requests_total{method="POST",route="/v1/systemone",status="422"} 1.0' in text
    assert 'clef_request_duration_seconds_bucket{le="+Inf",route="/v1/systemone"} 2.0' in text
    assert "clef_input_tokens_count 1.0" in text
    assert "clef_batch_size_count 1.0" in text
    assert "clef_queue_depth 0.0" in text
    assert 'clef_questions_total{type="noul"} 1.0' in text
    assert "clef_model_ready 1.0" in text


def test_unknown_paths_are_one_metric_label(client: TestClient) -> None:
    for path in ("/a", "/b", "/c/d"):
        assert_error_shape(client.get(path), 404, "not_found_error")
    assert 'route="unmatched",status="404"} 3.0' in client.get("/metrics").text


# --------------------------------------------------------------------------------------- request ids


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/systemone", REQUEST, 200),
        ("POST", "/v1/systemone", {"state": "x"}, 422),
        ("GET", "/nowhere", None, 404),
        ("GET", "/v1/systemone", None, 405),
        ("GET", "/health", None, 200),
        ("GET", "/metrics", None, 200),
    ],
)
def test_every_response_carries_a_request_id(
    client: TestClient, method: str, path: str, body: Any, status: int
) -> None:
    response = client.request(method, path, json=body)
    assert response.status_code == status
    assert len(response.headers["x-request-id"]) >= 16
    assert response.headers["x-typesafe-request-id"] == response.headers["x-request-id"]


def test_a_sane_incoming_request_id_is_kept_and_a_hostile_one_replaced(client: TestClient) -> None:
    assert (
        client.get("/health", headers={"x-request-id": "trace-42.a"}).headers["x-request-id"] == "trace-42.a"
    )
    replaced = client.get("/health", headers={"x-request-id": "x" * 500}).headers["x-request-id"]
    assert replaced != "x" * 500 and len(replaced) == 32


def test_internal_failure_is_a_500_naming_the_request_id_also_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="clef_runtime.server"):
        response = post(client, {**REQUEST, "state": f"boom {FAIL_MARKER}"})
    detail = assert_error_shape(response, 500, "internal_error")
    request_id = response.headers["x-request-id"]
    assert request_id in detail["message"] and detail["request_id"] == request_id
    assert any(
        request_id in record.getMessage() and record.levelno >= logging.ERROR for record in caplog.records
    )
    assert post(client, REQUEST).status_code == 200  # still serving


# ---------------------------------------------------------------------------------------------- auth


def test_authorization_header_is_ignored_when_auth_is_off(client: TestClient) -> None:
    for headers in (
        {"authorization": "Bearer whatever"},
        {"authorization": "Basic Zm9vOmJhcg=="},
        {"x-api-key": "k"},
    ):
        assert post(client, REQUEST, headers=headers).status_code == 200


@pytest.fixture
def secured(serve_fake: Callable[..., Served]) -> TestClient:
    return serve_fake(api_keys=("key-one", "schlüssel-zwei")).client


@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": "Bearer key-one"},
        {"authorization": "bearer   key-one "},
        {"x-api-key": "key-one"},
        {"authorization": "Bearer schlüssel-zwei".encode()},  # UTF-8 bytes on the wire
        {"authorization": "Bearer key-one", "x-api-key": "key-one"},  # systemone-client sends both
    ],
)
def test_a_configured_key_is_accepted_from_either_header(
    secured: TestClient, headers: dict[str, str]
) -> None:
    assert post(secured, REQUEST, headers=headers).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer nope"},
        {"authorization": "Bearer key-one-and-more"},
        {"authorization": "Bearer key-on"},
        {"authorization": "Basic a2V5LW9uZQ=="},
        {"x-api-key": "KEY-ONE"},
        {"authorization": "Bearer "},
    ],
)
def test_a_missing_or_wrong_key_gets_401_authentication_error(
    secured: TestClient, headers: dict[str, str]
) -> None:
    response = post(secured, REQUEST, headers=headers)
    assert_error_shape(response, 401, "authentication_error")
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert "x-request-id" in response.headers


def test_auth_guards_models_but_not_health(secured: TestClient) -> None:
    assert secured.get("/v1/models").status_code == 401
    assert secured.get("/v1/models", headers={"x-api-key": "key-one"}).status_code == 200
    assert post(secured, {"input": "x", "questions": []}, "/v1/decisions").status_code == 401
    assert secured.get("/health").status_code == 200
    assert secured.get("/ready").status_code == 200


# --------------------------------------------------------------------------------------- compression


def test_zstd_gzip_and_deflate_bodies_are_accepted(client: TestClient) -> None:
    raw = json.dumps({**REQUEST, "state": "refund " * 400}).encode()
    expected = post(client, raw).json()["answers"]
    encoders = {
        "zstd": zstandard.ZstdCompressor().compress,
        "gzip": gzip.compress,
        "x-gzip": gzip.compress,
        "deflate": zlib.compress,
        "identity": lambda data: data,
        "gzip, zstd": lambda data: zstandard.ZstdCompressor().compress(gzip.compress(data)),
    }
    for encoding, encode in encoders.items():
        response = post(client, encode(raw), headers={"content-encoding": encoding})
        assert response.status_code == 200, (encoding, response.text)
        assert response.json()["answers"] == expected


def test_zstd_without_a_declared_content_size_is_accepted(client: TestClient) -> None:
    raw = json.dumps(REQUEST).encode()
    compressor = zstandard.ZstdCompressor(write_content_size=False)
    streamed = compressor.compressobj().compress(raw) + compressor.compressobj().flush()
    chunker = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    streamed = chunker.compress(raw) + chunker.flush()
    assert post(client, streamed, headers={"content-encoding": "zstd"}).status_code == 200


def test_corrupt_or_unknown_encodings_are_4xx(client: TestClient) -> None:
    assert_error_shape(post(client, b"not zstd at all", headers={"content-encoding": "zstd"}), 400)
    assert_error_shape(post(client, b"\x1f\x8b garbage", headers={"content-encoding": "gzip"}), 400)
    assert_error_shape(
        post(client, gzip.compress(b'{"a":1}')[:-9], headers={"content-encoding": "gzip"}), 400
    )
    assert_error_shape(post(client, b"{}", headers={"content-encoding": "br"}), 415, "unsupported_media_type")


def test_decompression_bombs_are_413(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(max_body_bytes=64 * 1024).client
    bomb = b'{"state": "' + b" " * (10 * 1024 * 1024) + b'"}'
    for encoding, data in (
        ("zstd", zstandard.ZstdCompressor().compress(bomb)),
        ("gzip", gzip.compress(bomb)),
    ):
        assert len(data) < 64 * 1024
        response = post(client, data, headers={"content-encoding": encoding})
        assert_error_shape(response, 413, "request_too_large")
    assert post(client, REQUEST).status_code == 200


# ------------------------------------------------------------------------------------- bad-input battery


MALFORMED = [
    b"",
    b"   ",
    b"{",
    b'{"state": "x", "questions": {',
    b"[1, 2",
    b"nul",
    b'{"state": NaN, "questions": {}}',
    b'{"state": Infinity}',
    b"\xff\xfe{}",
    b'{"state": "\xc3\x28"}',
    b"[" * 100_000 + b"]" * 100_000,
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_json_is_422_with_the_validation_shape(client: TestClient, body: bytes) -> None:
    detail = assert_validation_shape(post(client, body))
    assert detail[0]["type"] == "json_invalid"


WRONG_TYPES: list[tuple[Any, list[Any]]] = [
    ([REQUEST], ["body"]),
    ("just a string", ["body"]),
    (None, ["body"]),
    ({**REQUEST, "model": 5}, ["body", "model"]),
    ({**REQUEST, "state": None}, ["body", "state"]),
    ({**REQUEST, "state": 3.5}, ["body", "state"]),
    ({**REQUEST, "questions": []}, ["body", "questions"]),
    ({**REQUEST, "questions": "refund?"}, ["body", "questions"]),
    ({**REQUEST, "questions": {}}, ["body", "questions"]),
    ({**REQUEST, "questions": {"q": "text"}}, ["body", "questions", "q"]),
    ({**REQUEST, "questions": {"q": {"instructions": "?"}}}, ["body", "questions", "q", "type"]),
    ({**REQUEST, "questions": {"q": {"type": "boolean"}}}, ["body", "questions", "q", "type"]),
    (
        {**REQUEST, "questions": {"q": {**NOUL, "instructions": 7}}},
        ["body", "questions", "q", "instructions"],
    ),
    ({**REQUEST, "questions": {"q": {**NOUL, "criteria": "yes"}}}, ["body", "questions", "q", "criteria"]),
    (
        {**REQUEST, "questions": {"q": {**NOUL, "criteria": {"maybe": "x"}}}},
        ["body", "questions", "q", "criteria"],
    ),
    (
        {**REQUEST, "questions": {"q": {**CHOICE, "criteria": ["a", "b"]}}},
        ["body", "questions", "q", "criteria"],
    ),
    (
        {**REQUEST, "questions": {"q": {**CHOICE, "criteria": {"a": 1, "b": None}}}},
        ["body", "questions", "q", "criteria", "a"],
    ),
    ({**REQUEST, "questions": {"q": {"type": "choice"}}}, ["body", "questions", "q", "criteria"]),
    (
        {**REQUEST, "questions": {"q": {**SCORE, "criteria": {"0": "a", "1": "b"}}}},
        ["body", "questions", "q", "criteria"],
    ),
    (
        {**REQUEST, "questions": {"q": {**SCORE, "criteria": ["a", None]}}},
        ["body", "questions", "q", "criteria", 1],
    ),
    (
        {**REQUEST, "questions": {"q": {**SCORE, "criteria": ["a", 2]}}},
        ["body", "questions", "q", "criteria", 1],
    ),
    ({**REQUEST, "questions": {"": NOUL}}, ["body", "questions"]),
]


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


# ------------------------------------------------------------------------------------ readiness, load


class LoadingEngine(FakeClef):
    """Warm-up waits for ``loaded`` so tests can look at the server while it is loading."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = threading.Event()

    def warmup(self, *, max_batch_tokens: int = 16384, max_batch_size: int = 32) -> None:
        assert self.loaded.wait(10)


def test_health_answers_at_once_and_everything_else_is_503_until_warm() -> None:
    engine = LoadingEngine()
    app = create_app(ServerSettings(model="fake"), engine_factory=lambda s: engine)
    with TestClient(app) as client:
        health = client.get("/health").json()
        assert (health["state"], health["ready"]) == ("loading", False)
        for response in (client.get("/ready"), post(client, REQUEST), client.get("/v1/models")):
            assert_error_shape(response, 503, "not_ready")
            assert int(response.headers["retry-after"]) >= 1
        engine.loaded.set()
        assert app.state.runtime.wait_until_loaded(10)
        assert client.get("/ready").status_code == 200
        assert post(client, REQUEST).status_code == 200


def test_a_failed_load_is_reported_and_fatal() -> None:
    fatal: list[BaseException] = []

    def broken(settings: ServerSettings) -> FakeClef:
        raise FileNotFoundError("no such checkpoint: /nowhere")

    app = create_app(ServerSettings(model="/nowhere"), engine_factory=broken, on_fatal=fatal.append)
    with TestClient(app) as client:
        app.state.runtime.wait_until_loaded(10)
        assert client.get("/health").json()["state"] == "failed"
        detail = assert_error_shape(client.get("/ready"), 503, "not_ready")
        assert "no such checkpoint" in detail["message"]
    assert isinstance(fatal[0], FileNotFoundError)


# ------------------------------------------------------------------------------------------ concurrency


def test_queue_full_is_429_with_retry_after(serve_fake: Callable[..., Served]) -> None:
    engine = FakeClef(delay_s=0.0)
    gate = threading.Event()
    original = engine.decide_encoded

    def held(items: Any) -> Any:
        assert gate.wait(10)
        return original(items)

    engine.decide_encoded = held  # type: ignore[method-assign]
    served = serve_fake(engine, max_queue=1, batch_window_ms=0)
    runtime = served.app.state.runtime
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, served.client, {**REQUEST, "state": "first"})
        _wait_for(lambda: runtime._running() == 1)
        queued = pool.submit(post, served.client, {**REQUEST, "state": "second"})
        _wait_for(lambda: runtime.queue_depth() == 1)
        refused = post(served.client, {**REQUEST, "state": "third"})
        assert_error_shape(refused, 429, "queue_full")
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        gate.set()
        assert running.result(10).status_code == 200
        assert queued.result(10).status_code == 200
    assert 'clef_rejected_requests_total{reason="queue_full"} 1.0' in served.client.get("/metrics").text


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def _mixed_requests(count: int) -> list[dict[str, Any]]:
    bodies = []
    for i in range(count):
        questions: dict[str, Any] = {"refund": NOUL}
        if i % 2:
            questions["team"] = CHOICE
        if i % 3:
            questions["urgency"] = SCORE
        bodies.append({"state": f"ticket {i}: " + "word " * (i * 7 % 50), "questions": questions})
    return bodies


def test_64_concurrent_mixed_requests_each_get_their_own_answer(serve_fake: Callable[..., Served]) -> None:
    # The engine holds its first call until the other 63 requests are queued behind it: they are then
    # batched whatever the machine's speed (no dependence on arrival times).
    engine = GatedEngine()
    served = serve_fake(engine, batch_window_ms=0)
    bodies = _mixed_requests(64)
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
    served = serve_fake(FakeClef(delay_s=0.05), batch_window_ms=50)
    bodies = [{**REQUEST, "state": f"ok {i}"} for i in range(5)] + [{**REQUEST, "state": FAIL_MARKER}]
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda body: post(served.client, body), bodies))
    assert [r.status_code for r in responses] == [200] * 5 + [500]


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

    def _answer(self, request: SystemOneRequest, record: Any) -> dict[str, Any]:
        answer = super()._answer(request, record)
        state = json.dumps(request.state, sort_keys=True)
        if state in self.seen:
            answer["x_state_cache"] = "hit"
            answer["usage"]["input_tokens_details"]["cached_tokens"] = max(1, record.input_tokens // 2)
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


# ------------------------------------------------------------------------------------------------ logs


def test_bodies_are_logged_only_with_log_requests(
    serve_fake: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    secret = "card 4111-1111-1111-1111"
    quiet = serve_fake().client
    with caplog.at_level(logging.DEBUG, logger="clef_runtime.server"):
        post(quiet, {**REQUEST, "state": secret})
    assert not any(secret in r.getMessage() for r in caplog.records)
    assert any("status=200" in r.getMessage() and "input_tokens=" in r.getMessage() for r in caplog.records)
    caplog.clear()
    loud = serve_fake(log_requests=True).client
    with caplog.at_level(logging.INFO, logger="clef_runtime.server"):
        post(loud, {**REQUEST, "state": secret})
    assert any(secret in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------- engine extensions


class RecordingEngine(FakeClef):
    """Keeps every item the server hands to ``decide_encoded``, and reports cache counters."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[Any] = []

    def decide_encoded(self, items: Any) -> list[dict[str, Any]]:
        self.items.extend(items)
        return super().decide_encoded(items)

    def cache_stats(self) -> dict[str, int]:
        return {
            "hits": 3,
            "partials": 2,
            "misses": 1,
            "entries": 2,
            "points": 2,
            "bytes": 4096,
            "capacity_bytes": 8192,
            "tokens_saved": 90,
            "reused_tokens": 70,
        }


def test_the_engine_gets_what_its_prepare_returned(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(RecordingEngine())
    body = {**REQUEST, "images": ["data:image/png;base64,AAAA"]}
    response = post(served.client, body)
    assert response.status_code == 200
    (image,) = served.engine.items[0].images  # not dropped on the way
    assert (image.data, image.content_type, image.loc) == (b"\x00\x00\x00", "image/png", ("images", 0))
    assert response.json()["answers"] == FakeClef().decide(REQUEST)["answers"]


def test_engine_cache_statistics_are_exported(serve_fake: Callable[..., Served]) -> None:
    text = serve_fake(RecordingEngine()).client.get("/metrics").text
    assert "clef_cache_hits_total 3.0" in text
    assert "clef_cache_tokens_saved_total 90.0" in text
    assert "clef_cache_partials_total 2.0" in text and "clef_cache_reused_tokens_total 70.0" in text
    assert "clef_cache_points 2.0" in text
    assert "# TYPE clef_cache_entries gauge" in text and "clef_cache_bytes 4096.0" in text
