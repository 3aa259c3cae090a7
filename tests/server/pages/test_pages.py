"""The pages' server side, without a browser: routes, content types, security headers, offline assets, and
the status figures (tests/server/pages/test_pages_browser.py drives the same pages in Chromium)."""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources

import pytest
from fastapi.testclient import TestClient

from clef_runtime.server.metrics import RecentRequests
from clef_runtime.server.pages.routes import STATIC_FILES, VENDOR_FILES
from tests.server.conftest import Served

NOUL = {"type": "noul", "instructions": "Is a refund requested?"}
PAGES = ("/", "/status", "/docs", "/redoc")
# An http(s) URL whose host is not this server's loopback address.
EXTERNAL_URL = re.compile(r"https?://(?!(?:127\.0\.0\.1|localhost)[:/])[A-Za-z0-9.-]+", re.IGNORECASE)


def _csp(response: object) -> dict[str, list[str]]:
    header = response.headers["content-security-policy"]  # type: ignore[attr-defined]
    directives = {}
    for part in header.split(";"):
        name, *values = part.split()
        directives[name] = values
    return directives


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/", "text/html; charset=utf-8"),
        ("/status", "text/html; charset=utf-8"),
        ("/docs", "text/html; charset=utf-8"),
        ("/redoc", "text/html; charset=utf-8"),
        ("/static/playground.js", "text/javascript; charset=utf-8"),
        ("/static/common.js", "text/javascript; charset=utf-8"),
        ("/static/status.js", "text/javascript; charset=utf-8"),
        ("/static/pages.css", "text/css; charset=utf-8"),
        ("/static/favicon.svg", "image/svg+xml"),
        ("/static/vendor/swagger-ui-bundle.js", "text/javascript; charset=utf-8"),
        ("/static/vendor/swagger-ui.css", "text/css; charset=utf-8"),
        ("/static/vendor/redoc.standalone.js", "text/javascript; charset=utf-8"),
    ],
)
def test_every_page_and_asset_is_served_with_its_content_type_and_no_key(
    serve_fake: Callable[..., Served], path: str, content_type: str
) -> None:
    client = serve_fake(api_keys=("secret",)).client  # the pages need no key even with auth on
    response = client.get(path)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == content_type
    assert response.headers["x-content-type-options"] == "nosniff"
    assert len(response.content) > 100


@pytest.mark.parametrize("path", PAGES)
def test_pages_allow_connections_and_scripts_from_this_server_only(client: TestClient, path: str) -> None:
    csp = _csp(client.get(path))
    assert csp["default-src"] == ["'self'"]
    assert csp["connect-src"] == ["'self'"]
    assert csp["img-src"] == ["'self'", "data:", "blob:"]
    assert csp["object-src"] == ["'none'"]
    # Scripts: this server's files, plus (docs pages only) the page's own bootstrap script by its hash.
    assert csp["script-src"][0] == "'self'"
    assert all(source.startswith("'sha256-") for source in csp["script-src"][1:])
    assert "'unsafe-inline'" not in csp["script-src"] and "'unsafe-eval'" not in csp["script-src"]


def test_our_pages_have_no_inline_script_or_style(client: TestClient) -> None:
    for path in ("/", "/status"):
        csp = _csp(client.get(path))
        assert csp["script-src"] == ["'self'"] and csp["style-src"] == ["'self'"]


def test_the_docs_bootstrap_script_hash_matches_the_page(client: TestClient) -> None:
    import base64
    import hashlib

    page = client.get("/docs")
    inline = re.findall(r"<script>(.*?)</script>", page.text, re.DOTALL)
    assert len(inline) == 1
    digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    assert _csp(page)["script-src"] == ["'self'", f"'sha256-{digest}'"]


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_docs_pages_load_their_files_from_this_server(client: TestClient, path: str) -> None:
    html = client.get(path).text
    assert EXTERNAL_URL.search(html) is None, EXTERNAL_URL.search(html)
    for url in re.findall(r'(?:src|href)="([^"]+)"', html):
        assert url.startswith("/"), url
        assert client.get(url).status_code == 200, url
    if path == "/docs":
        assert '"validatorUrl": null' in html  # else Swagger UI calls validator.swagger.io


def test_our_assets_name_no_other_host() -> None:
    static = resources.files("clef_runtime.server.pages") / "static"
    names = [*STATIC_FILES, "playground.html", "status.html"]
    for name in names:
        text = (static / name).read_text(encoding="utf-8")
        match = EXTERNAL_URL.search(text)
        # The SVG's XML namespace is an identifier, never fetched.
        if match and name == "favicon.svg" and match.group(0) == "http://www.w3.org":
            continue
        assert match is None, (name, match.group(0) if match else None)


def test_vendor_files_come_from_the_pinned_package() -> None:
    package = resources.files("fastapi_offline") / "static"
    for file in VENDOR_FILES.values():
        assert (package / file).is_file(), file


def test_status_json_reports_the_model_queue_requests_and_latency(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake()
    client = served.client
    before = client.get("/status.json").json()
    assert before["model"] == served.engine.name
    assert before["state"] == "ready"
    assert before["queue_depth"] == 0
    assert before["requests"] == {
        "total": 0,
        "rejected": 0,
        "errors": 0,
        "window": 0,
        "p50_ms": None,
        "p95_ms": None,
    }
    for _ in range(3):
        assert client.post("/v1/systemone", json={"state": "x", "questions": {"q": NOUL}}).status_code == 200
    assert client.post("/v1/systemone", json={"state": "x", "questions": {}}).status_code == 422
    client.get("/health")  # not a decision request
    after = client.get("/status.json").json()["requests"]
    assert (after["total"], after["rejected"], after["errors"], after["window"]) == (
        4,
        1,
        0,
        3,
    )  # 422: rejected
    assert 0 < after["p50_ms"] <= after["p95_ms"]


def test_status_json_reports_the_engine_cache_with_its_hit_rate(serve_fake: Callable[..., Served]) -> None:
    served = serve_fake()
    stats = {"hits": 3, "misses": 1, "bytes": 2048, "capacity_bytes": 4096, "entries": 1}
    served.engine.cache_stats = lambda: dict(stats)  # type: ignore[attr-defined]
    cache = served.client.get("/status.json").json()["state_cache"]
    assert cache == {**stats, "hit_rate": 0.75}


def test_status_json_has_no_cache_figures_for_an_engine_without_a_cache(client: TestClient) -> None:
    assert client.get("/status.json").json()["state_cache"] is None


def test_pages_are_not_in_the_api_schema_but_status_json_is(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/status.json" in paths
    for path in ("/", "/status", "/docs", "/redoc", "/static/playground.js"):
        assert path not in paths


def test_recent_requests_percentiles_are_nearest_rank_over_successes() -> None:
    recent = RecentRequests(window=4)
    for seconds in (0.5, 0.1, 0.4, 0.2, 0.3):  # the first falls out of the window of 4
        recent.add(200, seconds)
    recent.add(422, 9.0)
    summary = recent.summary()
    assert summary == {"total": 6, "rejected": 1, "errors": 0, "window": 4, "p50_ms": 200.0, "p95_ms": 400.0}


def test_redoc_is_served_without_its_cdn_logo(client: TestClient) -> None:
    shipped = (resources.files("fastapi_offline") / "static" / "redoc.standalone.js").read_bytes()
    assert b"https://cdn.redoc.ly/redoc/logo-mini.svg" in shipped  # else the patch is obsolete
    served = client.get("/static/vendor/redoc.standalone.js").content
    assert b"cdn.redoc.ly/redoc/logo-mini.svg" not in served
    assert len(served) == len(shipped) - len(b"https://cdn.redoc.ly/redoc/logo-mini.svg") + len(
        b"/static/favicon.svg"
    )
