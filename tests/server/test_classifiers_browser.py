"""The saved-classifiers page in a real browser: Playwright driving Debian's chromium against a live
fake-engine server with an API key. The page lists the key's classifiers, shows one's questions, runs it on
a state and draws the API's own numbers; it makes no request to another host and logs no error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.browser import chromium_browser, expected_meters
from tests.server.conftest import LiveServer
from tests.server.fake_engine import FakeClef

pytestmark = pytest.mark.slow

WAIT_MS = 60_000  # a generous bound for a shared machine; the tests wait for conditions, never for time
KEY = "s3cret"
QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Is a refund requested?"},
    "team": {"type": "choice", "criteria": {"billing": "charges, refunds", "tech": None}},
    "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium_browser() as launched:
        yield launched


def test_the_page_runs_a_saved_classifier_and_shows_the_api_numbers(
    browser: Any, live_fake: Callable[..., LiveServer]
) -> None:
    live = live_fake(FakeClef(), api_keys=(KEY,))
    headers = {"Authorization": f"Bearer {KEY}"}
    for name, description in (("abuse", None), ("triage", "Routes a support ticket.")):
        saved = httpx.put(
            f"{live.url}/v1/classifiers/{name}",
            json={"questions": QUESTIONS, "description": description},
            headers=headers,
            timeout=30,
        )
        assert saved.status_code == 201, saved.text
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.on("request", lambda request: requests.append(request.url))
    try:
        page.goto(live.url + "/classifiers")
        page.wait_for_selector("body[data-ready='true']")
        page.get_by_role("alert").filter(has_text="Enter the server's API key").wait_for()  # 401 without it
        page.get_by_label("API key").fill(KEY)
        page.get_by_label("API key").dispatch_event("change")
        page.get_by_text("2 saved classifier(s).").wait_for()
        page.get_by_label("Classifier", exact=True).select_option("triage")
        page.get_by_text("Routes a support ticket.").wait_for()
        assert "one of billing, tech" in page.locator("#question-list").inner_text()
        page.get_by_label("State", exact=True).fill("Charged twice, please refund today.")
        with page.expect_response(lambda r: r.url.endswith("/v1/classifiers/triage/decide")) as info:
            page.get_by_role("button", name="Run", exact=True).click()
        response = info.value
        assert response.status == 200
        assert response.request.headers["authorization"] == f"Bearer {KEY}"
        body = response.json()
        assert body["x_classifier"] == {"name": "triage", "version": 1}
        page.get_by_role("meter").first.wait_for()
        shown = {
            meter.get_attribute("aria-label"): float(meter.get_attribute("aria-valuenow"))
            for meter in page.get_by_role("meter").all()
        }
        assert shown == expected_meters(body)
        # The same answer the route gives anyone with the key.
        again = httpx.post(
            f"{live.url}/v1/classifiers/triage/decide",
            json={"state": "Charged twice, please refund today."},
            headers=headers,
            timeout=30,
        )
        assert again.json()["answers"] == body["answers"]
        assert page.evaluate("sessionStorage.getItem('clef-playground-api-key')") == KEY
        assert page.evaluate("localStorage.length") == 0
        foreign = [url for url in requests if urlsplit(url).hostname != "127.0.0.1"]
        assert foreign == []
        # The only error logged is the browser's note of the 401 before the key was given.
        assert all("401" in error for error in errors), errors
    finally:
        context.close()
