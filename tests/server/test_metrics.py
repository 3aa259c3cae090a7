"""The status page's request counts: a client's 4xx is a rejected request, only a 5xx is a server error."""

from __future__ import annotations

from collections.abc import Callable

from devtools.fake_engine import FAIL_MARKER

from clef_runtime.server.metrics import RecentRequests
from tests.server.conftest import Served
from tests.server.helpers import REQUEST, post


def test_4xx_are_rejected_and_only_5xx_are_errors() -> None:
    recent = RecentRequests()
    for status in (200, 201, 400, 401, 404, 413, 422, 429, 500, 503):
        recent.add(status, 0.01)
    summary = recent.summary()
    assert (summary["total"], summary["rejected"], summary["errors"], summary["window"]) == (10, 6, 2, 2)


def test_status_json_counts_client_refusals_apart_from_server_failures(
    serve_fake: Callable[..., Served],
) -> None:
    client = serve_fake(max_body_bytes=4096).client
    assert post(client, REQUEST).status_code == 200
    assert post(client, {"state": "x", "questions": {}}).status_code == 422
    assert post(client, b'{"state": "' + b"a" * 5000 + b'"}').status_code == 413
    assert post(client, {**REQUEST, "state": FAIL_MARKER}).status_code == 500
    requests = client.get("/status.json").json()["requests"]
    assert (requests["total"], requests["rejected"], requests["errors"], requests["window"]) == (4, 2, 1, 1)
