"""Response shapes of the decision, model, health and docs routes, and the request metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from devtools.fake_engine import FakeClef
from fastapi.testclient import TestClient

from tests.server.conftest import Served
from tests.server.helpers import REQUEST, assert_error_shape, assert_validation_shape, post

# The body of an answer on both decision routes: the API's fields and the server's x_ extensions.
RESPONSE_FIELDS = {
    "model",
    "answers",
    "usage",
    "x_truncated_state_tokens",
    "x_latency_ms",
    "x_state_cache",
    "x_head",
}


def test_systemone_answers_with_the_engine_response_plus_x_fields(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake()
    response = post(served.client, REQUEST)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    expected = FakeClef().decide(REQUEST)
    assert body == {**expected, "x_truncated_state_tokens": 0, "x_latency_ms": body["x_latency_ms"]}
    assert set(body) == RESPONSE_FIELDS
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
    assert set(out) == RESPONSE_FIELDS
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
    assert client.get("/ready").json() == {
        "status": "ready",
        "model": "fake-clef",
        "fused_kernels": {"in_use": False, "device": "cpu", "reason": "cpu", "calls": None, "conv": None},
    }
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
    assert "clef_step_rows_count 1.0" in text
    assert "clef_compute_seconds_count 1.0" in text and "clef_request_steps_count 1.0" in text
    assert "clef_queue_depth 0.0" in text
    assert 'clef_questions_total{type="noul"} 1.0' in text
    assert "clef_model_ready 1.0" in text


def test_unknown_paths_are_one_metric_label(client: TestClient) -> None:
    for path in ("/a", "/b", "/c/d"):
        assert_error_shape(client.get(path), 404, "not_found_error")
    assert 'route="unmatched",status="404"} 3.0' in client.get("/metrics").text
