"""The published API description: every operation is described for users, every request body has examples,
and every example is a request the server accepts."""

from __future__ import annotations

import io
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from clef_runtime.protocol.images import extract_images
from clef_runtime.server.openai.docs import CHAT_EXAMPLES
from clef_runtime.server.routes.decisions import DECISIONS_EXAMPLES
from clef_runtime.server.routes.systemone import SYSTEMONE_EXAMPLES
from clef_runtime.server.routes.workers_ai import WORKERS_AI_EXAMPLES


def _operations(client: TestClient) -> list[tuple[str, str, dict[str, Any]]]:
    schema = client.get("/openapi.json").json()
    return [(path, method, op) for path, ops in schema["paths"].items() for method, op in ops.items()]


def test_every_operation_has_a_summary_and_a_description_for_users(client: TestClient) -> None:
    operations = _operations(client)
    assert {path for path, _, _ in operations} >= {
        "/v1/systemone",
        "/v1/decisions",
        "/health",
        "/status.json",
    }
    for path, method, op in operations:
        assert op.get("summary"), (method, path)
        assert len(op.get("description", "")) > 60, (method, path)


# Answers that are not JSON: Prometheus text, and a job's results as JSONL (which has its own example).
NON_JSON_ANSWERS = {"/metrics": "text/plain", "/v1/jobs/{job_id}/results": "application/jsonl"}


def test_every_request_body_has_examples_and_json_answers_have_one(client: TestClient) -> None:
    for path, method, op in _operations(client):
        if method == "post":
            (media,) = op["requestBody"]["content"].values()  # one media type per body
            assert len(media["examples"]) >= 2, path
            continue
        success = op["responses"].get("200") or op["responses"]["202"]
        if path in NON_JSON_ANSWERS:
            assert path == "/metrics" or NON_JSON_ANSWERS[path] in success["content"], path
            continue
        assert "example" in success["content"]["application/json"], path


def test_the_systemone_operation_describes_both_image_forms(client: TestClient) -> None:
    op = client.get("/openapi.json").json()["paths"]["/v1/systemone"]["post"]
    text = op["description"] + op["requestBody"]["description"]
    for phrase in ("`images`", "image_url", "input_image", "data:", "at most 4"):
        assert phrase in text, phrase


@pytest.mark.parametrize("name", sorted(SYSTEMONE_EXAMPLES))
def test_every_systemone_example_is_accepted(client: TestClient, name: str) -> None:
    body = SYSTEMONE_EXAMPLES[name]["value"]
    response = client.post("/v1/systemone", json=body)
    assert response.status_code == 200, response.text
    assert set(response.json()["answers"]) == set(body["questions"])
    # The images pass the wire checks and are real pictures.
    _, images = extract_images(body)
    assert len(images) == {"images": 2, "image_parts": 1}.get(name, 0)
    for image in images:
        assert Image.open(io.BytesIO(image.data)).size == (1, 1)


@pytest.mark.parametrize("name", sorted(DECISIONS_EXAMPLES))
def test_every_decisions_example_is_accepted(client: TestClient, name: str) -> None:
    body = DECISIONS_EXAMPLES[name]["value"]
    response = client.post("/v1/decisions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["answers"]) == len(body["questions"])


@pytest.mark.parametrize("name", sorted(CHAT_EXAMPLES))
def test_every_chat_example_is_accepted(client: TestClient, name: str) -> None:
    body = CHAT_EXAMPLES[name]["value"]
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["object"] == "chat.completion"


@pytest.mark.parametrize("name", sorted(WORKERS_AI_EXAMPLES))
def test_every_workers_ai_example_is_accepted(client: TestClient, name: str) -> None:
    body = WORKERS_AI_EXAMPLES[name]["value"]
    response = client.post("/client/v4/accounts/0123abcd/ai/run/@cf/cloudflare/clef-flash", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["success"] is True
    assert set(response.json()["result"]["answers"]) == set(body["questions"])


def test_the_api_description_tells_of_saved_classifiers_and_mcp(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    description = schema["info"]["description"]
    for needle in (
        "POST /v1/systemone",
        "`/v1/classifiers`",
        "POST /v1/classifiers/{name}/decide",
        "POST /mcp",
    ):
        assert needle in description, needle
    assert "docs/classifiers.md" in description and "classify_<name>" in description
    assert "/mcp" not in schema["paths"]  # why the description has to say it: /docs lists no /mcp operation
    assert {"/v1/classifiers", "/v1/classifiers/{name}/decide"} <= set(schema["paths"])
