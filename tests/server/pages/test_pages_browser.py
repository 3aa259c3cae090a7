"""The pages in a real browser: Playwright driving Debian's chromium against a tiny-model server.

Every page is checked for console errors and for requests to any host but the server's loopback address.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from devtools.browser import TinyServer, chromium_browser, expected_meters, tiny_server
from devtools.fake_engine import FakeClef

from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

WAIT_MS = 60_000  # a generous bound for a shared machine; the tests wait for conditions, never for time


@pytest.fixture(scope="module")
def server() -> Iterator[TinyServer]:
    # CORS on for another origin: the pages' own origin must keep working whatever --cors-origin says.
    with tiny_server(cors_origins=("https://app.example",)) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium_browser() as launched:
        yield launched


@dataclass
class Watched:
    """A page with everything it logged and requested."""

    page: Any
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def foreign_requests(self) -> list[str]:
        """Requests to anything but 127.0.0.1 (data: and blob: URLs stay inside the page)."""
        return [
            url
            for url in self.requests
            if urlsplit(url).scheme not in ("data", "blob") and urlsplit(url).hostname != "127.0.0.1"
        ]


@pytest.fixture
def watched(browser: Any) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    seen = Watched(page)
    page.on("console", lambda msg: seen.console_errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: seen.console_errors.append(f"uncaught: {exc}"))
    page.on("request", lambda request: seen.requests.append(request.url))
    yield seen
    context.close()


def _open_playground(watched: Watched, server: TinyServer | LiveServer) -> Any:
    page = watched.page
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready='true']")
    return page


def _request_json(page: Any) -> dict[str, Any]:
    return json.loads(page.get_by_label("Request JSON").input_value())


def _decide(page: Any) -> Any:
    """Click Decide; returns the /v1/systemone response the page received."""
    with page.expect_response(lambda r: r.url.endswith("/v1/systemone")) as info:
        page.get_by_role("button", name="Decide", exact=True).click()
    return info.value


def _meters_on_page(page: Any) -> dict[str, float]:
    page.get_by_role("meter").first.wait_for()
    found = {}
    for meter in page.get_by_role("meter").all():
        found[meter.get_attribute("aria-label")] = float(meter.get_attribute("aria-valuenow"))
    return found


def _png(color: tuple[int, int, int], size: int = 24) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------ playground


def test_playground_decides_an_example_and_its_meters_are_the_api_numbers(
    watched: Watched, server: TinyServer
) -> None:
    page = _open_playground(watched, server)
    page.get_by_label("Example").select_option(label="Support ticket (yes/no, choice, score)")
    page.get_by_role("button", name="Load example").click()
    response = _decide(page)
    assert response.status == 200
    body = response.json()
    assert json.loads(response.request.post_data) == _request_json(page)
    assert {a["type"] for a in body["answers"].values()} == {"noul", "choice", "score"}

    expected = expected_meters(body)
    page.get_by_role("meter", name="urgency: 2", exact=True).wait_for()
    assert _meters_on_page(page) == expected  # exactly the numbers the API returned

    # The same request sent without the browser gets the same numbers.
    direct = httpx.post(server.url + "/v1/systemone", json=_request_json(page), timeout=120).json()
    assert expected_meters(direct) == pytest.approx(expected, abs=1e-4)

    usage = page.locator("#usage")
    assert usage.get_by_text("Input tokens").is_visible()
    assert str(body["usage"]["input_tokens"]) in usage.inner_text()
    assert "Truncated state tokens" in usage.inner_text()
    assert "Server latency" in usage.inner_text()
    assert watched.console_errors == []
    assert watched.foreign_requests() == []


def test_the_form_and_the_request_json_edit_the_same_request(watched: Watched, server: TinyServer) -> None:
    page = _open_playground(watched, server)
    page.get_by_role("button", name="Add choice question").click()
    question = page.locator("fieldset.question").last
    question.get_by_label("Question id").fill("color")
    question.get_by_label("Question id").press("Tab")  # ids are applied on change
    question.get_by_label("Instructions").fill("Which color?")
    question = page.locator("fieldset.question[data-qid='color']")
    question.get_by_label("Option 1 id").fill("red")
    question.get_by_label("Option 1 id").press("Tab")
    question = page.locator("fieldset.question[data-qid='color']")
    question.get_by_label("Option 1 description").fill("warm")
    sent = _request_json(page)
    assert sent["questions"]["color"] == {
        "type": "choice",
        "instructions": "Which color?",
        "criteria": {"red": "warm", "no": None},
    }

    # The other way: the text box drives the form.
    sent["questions"] = {
        "mood": {"type": "score", "instructions": "Mood?", "criteria": ["sad", "ok", "glad"]}
    }
    sent["state"] = {"text": "fine"}
    page.get_by_label("Request JSON").fill(json.dumps(sent))
    card = page.locator("fieldset.question[data-qid='mood']")
    assert card.get_by_label("Type").input_value() == "score"
    assert card.get_by_label("Level 2", exact=True).input_value() == "glad"
    assert page.get_by_label("JSON", exact=True).is_checked()
    assert json.loads(page.get_by_label("State", exact=True).input_value()) == {"text": "fine"}

    # Keyboard only: Ctrl+Enter from a text box decides.
    page.get_by_label("Instructions").focus()
    with page.expect_response(lambda r: r.url.endswith("/v1/systemone")) as info:
        page.keyboard.press("Control+Enter")
    assert info.value.status == 200
    page.get_by_role("meter", name="mood: 2", exact=True).wait_for()
    assert watched.console_errors == []


def test_an_invalid_request_shows_the_error_next_to_its_field(watched: Watched, server: TinyServer) -> None:
    page = _open_playground(watched, server)
    broken = _request_json(page)
    broken["questions"]["topic"]["criteria"] = {"billing": None}  # a choice needs at least 2 options
    page.get_by_label("Request JSON").fill(json.dumps(broken))
    response = _decide(page)
    assert response.status == 422
    [problem] = response.json()["detail"]
    assert problem["loc"] == ["body", "questions", "topic", "criteria"]
    criteria = page.locator("""[data-loc='["questions","topic","criteria"]']""")
    error = criteria.locator(".field-error")
    error.wait_for()
    assert error.inner_text() == f"questions.topic.criteria: {problem['msg']}"
    assert page.get_by_role("alert").filter(has_text="shown next to their fields").is_visible()
    # Fixing the field clears the error and the request goes through.
    page.locator("fieldset.question[data-qid='topic']").get_by_role("button", name="Add option").click()
    assert criteria.locator(".field-error").count() == 0
    assert _decide(page).status == 200
    # Only the browser's own note of the 422 was logged.
    assert all("422" in message for message in watched.console_errors), watched.console_errors


def test_uploaded_and_dropped_images_become_data_urls_and_are_decided(
    watched: Watched, server: TinyServer
) -> None:
    page = _open_playground(watched, server)
    red = _png((200, 30, 30))
    page.set_input_files("#image-input", files=[{"name": "red.png", "mimeType": "image/png", "buffer": red}])
    page.get_by_role("img", name="Image 1").wait_for()
    blue = _png((30, 30, 200))
    page.evaluate(
        """(b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const data = new DataTransfer();
            data.items.add(new File([bytes], "blue.png", { type: "image/png" }));
            document.getElementById("dropzone").dispatchEvent(
                new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true }));
        }""",
        base64.b64encode(blue).decode(),
    )
    page.get_by_role("img", name="Image 2").wait_for()
    images = _request_json(page)["images"]
    prefix = "data:image/png;base64,"
    assert [base64.b64decode(url.removeprefix(prefix)) for url in images] == [red, blue]
    assert all(url.startswith(prefix) for url in images)

    response = _decide(page)
    assert response.status == 200, response.text()
    assert json.loads(response.request.post_data)["images"] == images
    assert _meters_on_page(page) == expected_meters(response.json())
    assert watched.console_errors == []


def test_copy_as_gives_code_that_sends_the_current_request(
    watched: Watched, server: TinyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    page = _open_playground(watched, server)
    request = _request_json(page)
    page.get_by_text("Copy as code").click()
    snippet = page.locator("#snippet")
    page.get_by_role("button", name="curl", exact=True).click()
    curl = snippet.inner_text()
    assert curl.startswith(f"curl -sS {server.url}/v1/systemone")
    assert json.loads(curl.split("<<'JSON'\n", 1)[1].rsplit("\nJSON", 1)[0]) == request

    # Both Python snippets run as written against this server and get an answer to every question.
    for button, client_import in [
        ("Python (systemone-client)", "from systemone import Client"),
        ("Python (typesafe-sdk)", "from typesafe_sdk import TypeSafeClient"),
    ]:
        page.get_by_role("button", name=button).click()
        code = snippet.inner_text()
        assert client_import in code
        namespace: dict[str, Any] = {}
        exec(compile(code, button, "exec"), namespace)
        assert namespace["state"] == request["state"] and namespace["questions"] == request["questions"]
        printed = capsys.readouterr().out
        for qid in request["questions"]:
            assert qid in printed, (button, printed)


def test_the_playground_fits_a_phone_screen(browser: Any, server: TinyServer) -> None:
    context = browser.new_context(viewport={"width": 375, "height": 800})
    try:
        page = context.new_page()
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='true']")
        assert page.evaluate("document.documentElement.scrollWidth") <= 375
        assert page.get_by_role("button", name="Decide", exact=True).is_visible()
    finally:
        context.close()


# ------------------------------------------------------------------------------------------ status page


def test_the_status_page_shows_new_figures_after_a_request(watched: Watched, server: TinyServer) -> None:
    page = watched.page
    page.goto(server.url + "/status")
    page.locator("#s-model").filter(has_text="tiny").wait_for()
    assert page.locator("#s-untrained").inner_text() == "no (random weights)"
    backbone = server.app.state.runtime.engine.backbone
    assert page.locator("#s-device").inner_text() == str(backbone.device)
    assert page.locator("#s-weights").inner_text() == backbone.weight_mode
    assert page.locator("#s-dtype").inner_text() == backbone.dtype_name
    before = int(page.locator("#s-requests").inner_text())
    body = {"state": "status check", "questions": {"q": {"type": "noul", "instructions": "Is it?"}}}
    assert httpx.post(server.url + "/v1/systemone", json=body, timeout=120).status_code == 200
    page.locator("#s-requests").filter(has_text=str(before + 1)).wait_for()
    assert page.locator("#s-p50").inner_text().endswith(" ms")
    assert page.locator("#s-hit-rate").inner_text() != "-"
    # The tiny model runs on the CPU here: no fused kernels, and the page says why.
    assert page.locator("#s-fused").inner_text() == "not in use (cpu)"
    answered = page.locator("#s-answers tr").filter(has_text="(none)")
    answered.wait_for()
    assert int(answered.locator("td").nth(1).inner_text()) >= 1
    assert watched.console_errors == []
    assert watched.foreign_requests() == []


# ------------------------------------------------------------------------------------------ API docs


def test_swagger_ui_shows_the_systemone_operation_offline(watched: Watched, server: TinyServer) -> None:
    page = watched.page
    page.goto(server.url + "/docs")
    operation = page.locator(".opblock-summary-path[data-path='/v1/systemone']")
    operation.wait_for()
    operation.click()
    page.get_by_text("Example Value").first.wait_for()
    assert watched.console_errors == []
    assert watched.foreign_requests() == []


def test_redoc_renders_offline(watched: Watched, server: TinyServer) -> None:
    page = watched.page
    page.goto(server.url + "/redoc")
    page.get_by_role("heading", name="Answer System One questions about a state").first.wait_for()
    assert watched.console_errors == []
    assert watched.foreign_requests() == []


def test_the_api_key_is_sent_when_given_and_kept_in_the_tab_only(
    watched: Watched, live_fake: Callable[..., LiveServer]
) -> None:
    live = live_fake(FakeClef(), api_keys=("s3cret",))
    page = watched.page
    page.goto(live.url + "/")
    page.wait_for_selector("body[data-ready='true']")
    page.get_by_text("This server requires an API key").wait_for()
    refused = _decide(page)
    assert refused.status == 401
    page.get_by_role("alert").filter(has_text="Enter the server's API key").wait_for()
    page.get_by_label("API key").fill("s3cret")
    accepted = _decide(page)
    assert accepted.status == 200
    assert accepted.request.headers["authorization"] == "Bearer s3cret"
    assert page.evaluate("sessionStorage.getItem('clef-playground-api-key')") == "s3cret"
    assert page.evaluate("localStorage.length") == 0
    page.get_by_text("Copy as code").click()
    page.get_by_role("button", name="curl", exact=True).click()
    curl = page.locator("#snippet").inner_text()
    assert "$CLEF_API_KEY" in curl and "s3cret" not in curl  # the key never lands in copied code


# ------------------------------------------------------------------------------------------ evidence
# The fake engine answers x_explain in the real wire shape with evidence computed from the state (see
# devtools/fake_engine.py), so these check the marks against the exact spans the API sent.


@pytest.fixture
def fake_playground(watched: Watched, live_fake: Callable[..., LiveServer]) -> Any:
    """The playground of a fake-engine server, open in ``watched``."""
    return _open_playground(watched, live_fake(FakeClef()))


def _evidence_shown(page: Any) -> list[dict[str, Any]]:
    """The marks in the evidence panel's state text, in text order."""
    page.locator("#evidence mark").first.wait_for()
    return [
        {
            "text": mark.text_content(),
            "title": mark.get_attribute("title"),
            "negative": "negative" in (mark.get_attribute("class") or ""),
        }
        for mark in page.locator("#evidence mark").all()
    ]


def _evidence_expected(text: str, qid: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The marks an answer's x_evidence should give: Python slices (code point offsets) of the text, with the
    question, rank and signed weight in the tooltip."""
    ranked = sorted((item["start"], rank, item) for rank, item in enumerate(items, 1) if "start" in item)
    return [
        {
            "text": text[item["start"] : item["end"]],
            "title": f"{qid} · evidence {rank} · weight {item['weight']:+.4f}"
            + (f" · {item['path']}" if "path" in item else ""),
            "negative": item["weight"] < 0,
        }
        for _, rank, item in ranked
    ]


def test_the_playground_marks_each_answers_evidence_past_an_emoji(
    watched: Watched, fake_playground: Any
) -> None:
    page = fake_playground
    # Astral characters before the evidence: a UTF-16 index would land one character off per emoji.
    state = "🙂 <b>Charged</b> twice 🎉 for order 1042, refund please"
    request = {
        "state": state,
        "questions": {
            "refund": {"type": "noul", "instructions": "Is a refund asked for?"},
            "topic": {"type": "choice", "criteria": {"billing": None, "shipping": None}},
        },
    }
    page.get_by_label("Request JSON").fill(json.dumps(request))
    page.get_by_label("Explain each answer").check()
    page.get_by_label("Spans per answer (1-20)").fill("4")
    page.get_by_label("Granularity").select_option("word")
    assert _request_json(page)["x_explain"] == {"top_k": 4, "granularity": "word"}

    response = _decide(page)
    assert response.status == 200
    assert json.loads(response.request.post_data)["x_explain"] == {"top_k": 4, "granularity": "word"}
    answers = response.json()["answers"]
    assert [len(a["x_evidence"]) for a in answers.values()] == [4, 4]

    shown = _evidence_shown(page)
    assert shown == _evidence_expected(state, "refund", answers["refund"]["x_evidence"])
    assert [mark["text"] for mark in shown] == ["b", "Charged", "b", "twice"]  # the first is the <b> tag's
    assert shown[2]["negative"] and not shown[0]["negative"]
    # The state is text, never markup: the whole state reads back unchanged, with no element made of it.
    assert page.locator(".evidence-text").text_content() == state
    assert page.locator("#evidence b").count() == 0

    # The selector shows the other question's evidence; each answer lists its spans.
    page.get_by_label("Highlight the evidence for").select_option("topic")
    page.locator("#evidence mark").first.filter(has_text="Charged").wait_for()
    assert _evidence_shown(page) == _evidence_expected(state, "topic", answers["topic"]["x_evidence"])
    listed = page.get_by_role("list", name="Evidence for refund").get_by_role("listitem")
    assert listed.count() == 4
    assert listed.first.inner_text().startswith("+1.0000")
    assert watched.console_errors == []
    assert watched.foreign_requests() == []


def test_the_playground_marks_evidence_in_a_json_states_rendered_text(
    watched: Watched, fake_playground: Any
) -> None:
    page = fake_playground
    request = {
        "state": {"ticket": {"subject": "Lost 📦 parcel", "body": "Refund me 😠 now", "id": 7}},
        "questions": {"refund": {"type": "noul", "instructions": "Is a refund asked for?"}},
        "x_explain": {"top_k": 9},
    }
    page.get_by_label("Request JSON").fill(json.dumps(request))
    assert page.get_by_label("Explain each answer").is_checked()  # the form follows the request JSON
    response = _decide(page)
    assert response.status == 200
    body = response.json()
    text = body["x_explain"]["state_text"]
    evidence = body["answers"]["refund"]["x_evidence"]
    assert {item["path"] for item in evidence} >= {"/ticket/body", "/ticket/subject"}
    assert _evidence_shown(page) == _evidence_expected(text, "refund", evidence)
    assert page.locator(".evidence-text").text_content() == text
    assert "/ticket/subject" in page.get_by_role("list", name="Evidence for refund").inner_text()
    assert watched.console_errors == []


def test_image_evidence_is_a_box_over_the_images_preview(watched: Watched, fake_playground: Any) -> None:
    page = fake_playground
    image = "data:image/png;base64," + base64.b64encode(_png((200, 30, 30), size=64)).decode()
    request = {
        "state": "a photo",
        "images": [image],
        "questions": {"damaged": {"type": "noul"}},
        "x_explain": True,
    }
    page.get_by_label("Request JSON").fill(json.dumps(request))
    response = _decide(page)
    assert response.status == 200
    [patch] = [item for item in response.json()["answers"]["damaged"]["x_evidence"] if "image" in item]
    assert patch["box"] == [0, 0, 16, 16]
    box = page.locator("#evidence .evidence-box")
    box.wait_for()
    # 16 of the image's 64 pixels: a quarter of the preview, whatever size the preview is drawn at.
    assert box.evaluate("b => [b.style.left, b.style.top, b.style.width, b.style.height]") == [
        "0%",
        "0%",
        "25%",
        "25%",
    ]
    assert "weight +0.5000" in box.get_attribute("title")
    assert "image 1, box [0, 0, 16, 16]" in page.get_by_role("list", name="Evidence for damaged").inner_text()
    assert watched.console_errors == []


def test_the_classifiers_page_marks_the_evidence_of_a_run(
    watched: Watched, live_fake: Callable[..., LiveServer]
) -> None:
    live = live_fake(FakeClef())
    questions = {"refund": {"type": "noul", "instructions": "Is a refund asked for?"}}
    saved = httpx.put(f"{live.url}/v1/classifiers/triage", json={"questions": questions}, timeout=30)
    assert saved.status_code == 201, saved.text
    page = watched.page
    page.goto(live.url + "/classifiers")
    page.wait_for_selector("body[data-ready='true']")
    page.get_by_label("State", exact=True).fill("😀 Please refund the second charge")
    page.get_by_label("Explain each answer").check()
    page.get_by_label("Spans per answer (1-20)").fill("3")
    with page.expect_response(lambda r: r.url.endswith("/v1/classifiers/triage/decide")) as info:
        page.get_by_role("button", name="Run", exact=True).click()
    response = info.value
    assert response.status == 200
    assert json.loads(response.request.post_data)["x_explain"] == {"top_k": 3, "granularity": "word"}
    evidence = response.json()["answers"]["refund"]["x_evidence"]
    shown = _evidence_shown(page)
    assert shown == _evidence_expected("😀 Please refund the second charge", "refund", evidence)
    assert [mark["text"] for mark in shown] == ["Please", "refund", "the"]
    assert watched.console_errors == []
