"""Cross-origin calls (``--cors-origin``): none by default, the configured origins' pages allowed (preflight
before auth, headers on errors too), any other origin not, and the server's own pages always."""

from __future__ import annotations

from collections.abc import Callable

from tests.server.conftest import Served
from tests.server.helpers import REQUEST

APP = "https://app.example"


def _preflight(served: Served, origin: str, headers: str = "authorization, content-type") -> object:
    return served.client.options(
        "/v1/systemone",
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": headers,
        },
    )


def test_no_origin_is_allowed_by_default(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake()
    preflight = served.client.options(
        "/v1/systemone", headers={"origin": APP, "access-control-request-method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    answer = served.client.post("/v1/systemone", json=REQUEST, headers={"origin": APP})
    # Answered (CORS is the browser's to enforce), but without the header its page may not read it.
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_a_configured_origin_may_call_and_read_answers_and_errors(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(cors_origins=(APP,), api_keys=("k",))
    # A browser SDK's own headers (the OpenAI SDK's x-stainless-*) pass the preflight too; it carries no key.
    preflight = _preflight(served, APP, "authorization, content-type, x-stainless-os")
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "x-stainless-os" in preflight.headers["access-control-allow-headers"].lower()
    answer = served.client.post(
        "/v1/systemone", json=REQUEST, headers={"origin": APP, "authorization": "Bearer k"}
    )
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP
    exposed = answer.headers["access-control-expose-headers"].lower()
    assert "x-request-id" in exposed and "retry-after" in exposed and "x-clef-head" in exposed
    refused = served.client.post("/v1/systemone", json=REQUEST, headers={"origin": APP})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP


def test_another_origin_is_not_allowed(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(cors_origins=(APP,))
    preflight = _preflight(served, "https://evil.example")
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    answer = served.client.post("/v1/systemone", json=REQUEST, headers={"origin": "https://evil.example"})
    assert "access-control-allow-origin" not in answer.headers


def test_the_servers_own_pages_work_whatever_is_configured(serve_fake: Callable[..., Served]) -> None:
    # The playground posts from the server's own origin: same origin, no preflight, no CORS header needed.
    for origins in ((), (APP,), ("*",)):
        served = serve_fake(cors_origins=origins)
        own = str(served.client.base_url).rstrip("/")
        assert served.client.get("/").status_code == 200
        answer = served.client.post("/v1/systemone", json=REQUEST, headers={"origin": own})
        assert answer.status_code == 200, answer.text


def test_any_origin_with_a_star(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake(cors_origins=("*",))
    answer = served.client.post("/v1/systemone", json=REQUEST, headers={"origin": "https://any.example"})
    assert answer.headers["access-control-allow-origin"] == "*"
