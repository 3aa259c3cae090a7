"""``x_explain`` on ``/v1/chat/completions`` and ``/v1/responses``: a top-level extension field that reaches
the engine as sent, whose evidence comes back in ``x_decisions`` (each answer's ``x_evidence``) with the
body's ``x_explain`` record beside it; a bad value is refused in OpenAI's error shape naming the field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from clef_runtime.engine.clef import Clef
from clef_runtime.protocol.explain import ExplainOptions
from tests.live_server import Live
from tests.server.conftest import Served
from tests.server.explaining_engine import FAKE_METHOD, ExplainingEngine
from tests.server.openai.test_compat_api import CHAT, CHAT_PATH, SCHEMA, assert_openai_error

RESPONSES: dict[str, Any] = {
    "model": "clef",
    "input": "I was charged twice, fix it today!",
    "text": {"format": {"type": "json_schema", "name": "ticket", "schema": SCHEMA, "strict": True}},
}
ROUTES = {CHAT_PATH: CHAT, "/v1/responses": RESPONSES}


@pytest.fixture
def explaining(serve_fake: Callable[..., Served]) -> Served:
    return serve_fake(ExplainingEngine())


def _with(body: dict[str, Any], x_explain: Any) -> dict[str, Any]:
    return {**copy.deepcopy(body), "x_explain": x_explain}


@pytest.mark.parametrize("path", ROUTES)
def test_x_explain_reaches_the_engine_and_the_evidence_comes_back_in_x_decisions(
    explaining: Served, path: str
) -> None:
    response = explaining.client.post(path, json=_with(ROUTES[path], {"top_k": 2, "granularity": "token"}))
    assert response.status_code == 200, response.text
    assert explaining.engine.explained == [ExplainOptions(top_k=2, granularity="token")]  # type: ignore[attr-defined]
    body = response.json()
    assert body["x_explain"]["method"] == FAKE_METHOD and body["x_explain"]["top_k"] == 2
    assert set(body["x_decisions"]) == set(SCHEMA["properties"])  # type: ignore[arg-type]
    for answer in body["x_decisions"].values():
        assert 1 <= len(answer["x_evidence"]) <= 2


@pytest.mark.parametrize("path", ROUTES)
def test_without_x_explain_nothing_is_asked_or_added(explaining: Served, path: str) -> None:
    body = explaining.client.post(path, json=ROUTES[path]).json()
    assert explaining.engine.explained == [None]  # type: ignore[attr-defined]
    assert "x_explain" not in body
    assert all("x_evidence" not in answer for answer in body["x_decisions"].values())


def test_a_streamed_chat_completion_carries_the_explain_record(explaining: Served) -> None:
    response = explaining.client.post(CHAT_PATH, json={**_with(CHAT, True), "stream": True})
    assert response.status_code == 200, response.text
    assert '"x_explain"' in response.text and '"x_evidence"' in response.text


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"top_k": 0}, "x_explain.top_k"),
        ({"top_k": 99}, "x_explain.top_k"),
        ({"granularity": "page"}, "x_explain.granularity"),
        ("on", "x_explain"),
    ],
)
def test_a_bad_x_explain_is_refused_in_openai_shape_naming_the_field(
    explaining: Served, path: str, value: Any, param: str
) -> None:
    response = explaining.client.post(path, json=_with(ROUTES[path], value))
    message = assert_openai_error(response, 400, param, response.json()["error"]["code"])
    assert message.startswith(param)
    assert explaining.engine.explained == []  # type: ignore[attr-defined]


def test_a_live_tiny_server_returns_the_evidence_in_x_decisions(tiny: Clef) -> None:
    """The real engine behind a real server: the chat's evidence is spans of the state the model read."""
    live = Live(tiny)
    try:
        response = httpx.post(live.url + CHAT_PATH, json=_with(CHAT, {"top_k": 3}), timeout=120)
    finally:
        live.stop()
    assert response.status_code == 200, response.text
    body = response.json()
    record = body["x_explain"]
    assert record["method"] == "integrated_gradients" and record["top_k"] == 3
    rendered = record.get("state_text", CHAT["messages"][-1]["content"])
    assert set(body["x_decisions"]) == set(SCHEMA["properties"])  # type: ignore[arg-type]
    for answer in body["x_decisions"].values():
        assert 1 <= len(answer["x_evidence"]) <= 3
        for span in answer["x_evidence"]:
            assert rendered[span["start"] : span["end"]] == span["text"]
