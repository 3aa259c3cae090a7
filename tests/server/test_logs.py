"""Request logs: bodies only with --log-requests."""

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
