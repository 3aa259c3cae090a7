"""The saved-classifiers page without a browser: served with its script under the pages' CSP, needing no
key, naming no other host, and linked from the other pages
(tests/server/classifiers/test_classifiers_browser.py runs it in Chromium)."""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources

import torch
from fastapi.testclient import TestClient

from clef_runtime.model.compute_dtype import dtype_name
from clef_runtime.server.pages.routes import PAGE_CSP, STATIC_FILES
from tests.server.conftest import Served
from tests.server.pages.test_pages import EXTERNAL_URL


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


def test_the_page_has_a_place_for_the_head_pin_and_nothing_inline(client: TestClient) -> None:
    """The details show the classifier's head pin (filled by the script from ``head_status``); the page
    stays within its CSP: no inline script or style."""
    page = client.get("/classifiers").text
    assert '<div id="pin" class="pin"></div>' in page
    assert "<style" not in page and " style=" not in page
    assert all('src="' in tag for tag in re.findall(r"<script[^>]*>", page))
    script = client.get("/static/classifiers.js").text
    assert "head_status" in script and '"head not loaded"' in script and '"head changed"' in script


def test_the_page_names_no_other_host() -> None:
    static = resources.files("clef_runtime.server.pages") / "static"
    for name in ("classifiers.html", "classifiers.js"):
        assert EXTERNAL_URL.search((static / name).read_text(encoding="utf-8")) is None, name


def test_the_other_pages_link_to_it_and_it_is_not_in_the_api_schema(client: TestClient) -> None:
    for path in ("/", "/status"):
        assert 'href="/classifiers"' in client.get(path).text, path
    assert "/classifiers" not in client.get("/openapi.json").json()["paths"]


def test_the_status_example_has_the_fields_and_words_the_server_reports(client: TestClient) -> None:
    """The documented ``/status.json`` example (shown with the status page's API docs) names only fields the
    route returns, and a bf16 server's weight mode as the server says it (``bf16``, not torch's name). (The
    schema drops the example's null ``replicas``, hence a subset.)"""
    documented = client.get("/openapi.json").json()["paths"]["/status.json"]["get"]["responses"]["200"]
    example = documented["content"]["application/json"]["example"]
    assert set(example) <= set(client.get("/status.json").json())
    assert example["weights"] == example["compute_dtype"] == dtype_name(torch.bfloat16)
