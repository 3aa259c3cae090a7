"""Request logs: bodies only with --log-requests; the caller's key by its name, never the key."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.server.conftest import Served
from tests.server.helpers import REQUEST, post


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


def test_a_request_log_line_names_the_key_and_never_holds_it(
    serve_fake: Callable[..., Served], caplog: pytest.LogCaptureFixture
) -> None:
    client = serve_fake(api_keys=("alice:secret1", "bob:secret2"), log_requests=True).client
    with caplog.at_level(logging.DEBUG):
        assert post(client, REQUEST, headers={"Authorization": "Bearer secret1"}).status_code == 200
        assert client.get("/v1/models", headers={"X-API-Key": "secret2"}).status_code == 200
        assert post(client, REQUEST, headers={"Authorization": "Bearer wrong"}).status_code == 401
    lines = [r.getMessage() for r in caplog.records]
    assert any("POST /v1/systemone status=200" in line and " key=alice " in line for line in lines)
    assert any("GET /v1/models status=200" in line and line.endswith(" key=bob") for line in lines)
    assert any("status=401" in line and "key=" not in line for line in lines)
    assert not any("secret1" in line or "secret2" in line for line in lines)
