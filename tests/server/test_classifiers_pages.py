"""The saved-classifiers page without a browser: served with its script under the pages' CSP, needing no
key, naming no other host, and linked from the other pages (tests/server/test_classifiers_browser.py runs
it in Chromium)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from fastapi.testclient import TestClient

from clef_runtime.server.routes_pages import PAGE_CSP, STATIC_FILES
from tests.server.conftest import Served
from tests.server.test_pages import EXTERNAL_URL


def test_the_page_and_its_script_are_served_without_a_key(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(api_keys=("secret",)).client  # the page asks for the key; it needs none itself
    page = client.get("/classifiers")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == PAGE_CSP
    assert '<script src="/static/classifiers.js" defer></script>' in page.text
    assert "classifiers.js" in STATIC_FILES
    script = client.get("/static/classifiers.js")
    assert script.status_code == 200 and script.headers["content-type"] == "text/javascript; charset=utf-8"
    # It calls the API routes it documents.
    assert "/v1/classifiers" in script.text and "/decide" in script.text


def test_the_page_names_no_other_host() -> None:
    static = resources.files("clef_runtime.server") / "static"
    for name in ("classifiers.html", "classifiers.js"):
        assert EXTERNAL_URL.search((static / name).read_text(encoding="utf-8")) is None, name


def test_the_other_pages_link_to_it_and_it_is_not_in_the_api_schema(client: TestClient) -> None:
    for path in ("/", "/status"):
        assert 'href="/classifiers"' in client.get(path).text, path
    assert "/classifiers" not in client.get("/openapi.json").json()["paths"]
