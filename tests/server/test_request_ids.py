"""Every response carries a request id; a sane incoming one is kept, and a 500 names it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from devtools.fake_engine import FAIL_MARKER
from fastapi.testclient import TestClient

from tests.server.helpers import REQUEST, assert_error_shape, post


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
