"""The saved-classifiers page in a real browser: Playwright driving Debian's chromium against a live
fake-engine server with an API key. The page lists the key's classifiers, shows one's questions, runs it on
a state and draws the API's own numbers; it makes no request to another host and logs no error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from devtools.browser import chromium_browser, expected_meters
from devtools.fake_engine import FakeClef

from tests.server.conftest import LiveServer

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
        # Saved without a head: the default head, pinned and served, so no badge.
        assert "Head: default head · pinned digest" in page.locator("#pin").inner_text()
        assert page.locator("#pin .badge").count() == 0
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


def _open_with_key(browser: Any, url: str) -> tuple[Any, Any, list[str]]:
    """A page on ``url`` with the key already in this tab's sessionStorage, its list loaded; the errors it
    logs are collected."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_MS)
    context.add_init_script(f"sessionStorage.setItem('clef-playground-api-key', {KEY!r})")
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    page.goto(url)
    page.wait_for_selector("body[data-ready='true']")
    return context, page, errors


def _shown_pin(page: Any) -> tuple[str, list[str], list[str | None]]:
    """The pin's text, its badges and the full digests in its tooltips, after a fresh load of the page."""
    page.reload()
    page.wait_for_selector("body[data-ready='true']")
    page.get_by_label("Classifier", exact=True).select_option("billing-triage")
    pin = page.locator("#pin")
    pin.get_by_text("Head:").wait_for()
    badges = pin.locator(".badge").all_inner_texts()
    return pin.inner_text(), badges, [code.get_attribute("title") for code in pin.locator("code").all()]


def test_the_page_shows_the_head_pin_and_marks_it_when_the_head_is_unloaded_or_changed(
    browser: Any, live_fake: Callable[..., LiveServer]
) -> None:
    engine = FakeClef()
    engine.load_head("billing", "/heads/a")
    live = live_fake(engine, api_keys=(KEY,))
    headers = {"Authorization": f"Bearer {KEY}"}
    saved = httpx.put(
        f"{live.url}/v1/classifiers/billing-triage",
        json={"questions": QUESTIONS, "head": "billing"},
        headers=headers,
        timeout=30,
    )
    assert saved.status_code == 201, saved.text
    pinned = saved.json()["head_digest"]
    context, page, errors = _open_with_key(browser, live.url + "/classifiers")
    try:
        # Intact: the head's name and the pinned digest's first 12 hex (full in the tooltip), no badge.
        text, badges, titles = _shown_pin(page)
        assert f"Head: billing · pinned digest {pinned[:12]}" in text and pinned[12:] not in text
        assert (badges, titles) == ([], [pinned])
        assert page.locator("#pin .pin-hint").count() == 0

        # Unloaded while the page is open: Run shows the server's 503 message (never a silent failure)
        # and the page lists the pins again, so the badge appears without a reload.
        engine.unload_head("billing")
        page.get_by_label("State", exact=True).fill("Charged twice.")
        page.get_by_role("button", name="Run", exact=True).click()
        alert = page.get_by_role("alert")
        alert.filter(has_text="The server answered 503").wait_for()
        assert "which this server does not serve" in alert.inner_text()
        page.locator("#pin .badge").filter(has_text="head not loaded").wait_for()

        text, badges, titles = _shown_pin(page)
        assert badges == ["head not loaded"] and titles == [pinned]
        assert "clef serve --head billing=DIR" in page.locator("#pin .pin-hint").inner_text()
        assert "head not loaded" in page.locator("#classifier option").inner_text()

        served = engine.load_head("billing", "/heads/b").digest
        text, badges, titles = _shown_pin(page)
        assert badges == ["head changed"] and titles == [pinned, served]
        assert f"served now {served[:12]}" in text
        hint = page.locator("#pin .pin-hint").inner_text()
        assert "save the classifier again (PUT /v1/classifiers/billing-triage)" in hint
        page.get_by_label("State", exact=True).fill("Charged twice.")
        page.get_by_role("button", name="Run", exact=True).click()
        alert.filter(has_text="The server answered 409").wait_for()
        assert "PUT /v1/classifiers/billing-triage again" in alert.inner_text()
        assert page.get_by_role("meter").count() == 0
        # The only errors logged are the browser's notes of the refused runs.
        assert all("409" in error or "503" in error for error in errors), errors
    finally:
        context.close()
