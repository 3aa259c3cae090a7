"""What the HTTP API tests share: common request bodies (one request, a mix of many), the bad-input battery's
bodies, and the helpers that post a body, check the two error shapes and wait for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

NOUL = {"type": "noul", "instructions": "Is a refund requested?"}
CHOICE = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "charges", "tech": None}}
SCORE = {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]}
REQUEST = {
    "model": "jev-latest",
    "state": {"ticket": "Charged twice, please refund today."},
    "questions": {"refund": NOUL, "team": CHOICE, "urgency": SCORE},
}


def mixed_requests(count: int) -> list[dict[str, Any]]:
    """``count`` System One requests of mixed question sets and state kinds (text, JSON) and lengths."""
    bodies = []
    for i in range(count):
        questions: dict[str, Any] = {"refund": NOUL}
        if i % 2:
            questions["team"] = CHOICE
        if i % 3:
            questions["urgency"] = SCORE
        state: Any = f"Ticket {i}: " + "please refund my order " * (i % 9 * 3)
        if i % 4 == 0:
            state = {"ticket": i, "text": state}
        bodies.append({"model": "jev-latest", "state": state, "questions": questions})
    return bodies


def post(client: TestClient, body: Any, path: str = "/v1/systemone", **kwargs: Any) -> Any:
    if isinstance(body, bytes):
        return client.post(
            path,
            content=body,
            headers={"content-type": "application/json", **kwargs.pop("headers", {})},
            **kwargs,
        )
    return client.post(path, json=body, **kwargs)


def assert_validation_shape(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, list) and detail
    for item in detail:
        assert set(item) == {"loc", "msg", "type"}
        assert item["loc"][0] == "body"
        assert isinstance(item["msg"], str) and isinstance(item["type"], str)
    return detail


def assert_error_shape(response: Any, status: int, error_type: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail["error_type"], str) and isinstance(detail["message"], str)
    if error_type is not None:
        assert detail["error_type"] == error_type
    return detail


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds (a bound on waiting, not a timing assumption)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


# The bad-input battery: malformed JSON bodies, and wrong types at every level with the location the 422
# must name (also sent to a real server by tests/server/routes/test_conformance.py).
MALFORMED = [
    b"",
    b"   ",
    b"{",
    b'{"state": "x", "questions": {',
    b"[1, 2",
    b"nul",
    b'{"state": NaN, "questions": {}}',
    b'{"state": Infinity}',
    b"\xff\xfe{}",
    b'{"state": "\xc3\x28"}',
    b"[" * 100_000 + b"]" * 100_000,
]

WRONG_TYPES: list[tuple[Any, list[Any]]] = [
    ([REQUEST], ["body"]),
    ("just a string", ["body"]),
    (None, ["body"]),
    ({**REQUEST, "model": 5}, ["body", "model"]),
    ({**REQUEST, "state": None}, ["body", "state"]),
    ({**REQUEST, "state": 3.5}, ["body", "state"]),
    ({**REQUEST, "questions": []}, ["body", "questions"]),
    ({**REQUEST, "questions": "refund?"}, ["body", "questions"]),
    ({**REQUEST, "questions": {}}, ["body", "questions"]),
    ({**REQUEST, "questions": {"q": "text"}}, ["body", "questions", "q"]),
    ({**REQUEST, "questions": {"q": {"instructions": "?"}}}, ["body", "questions", "q", "type"]),
    ({**REQUEST, "questions": {"q": {"type": "boolean"}}}, ["body", "questions", "q", "type"]),
    (
        {**REQUEST, "questions": {"q": {**NOUL, "instructions": 7}}},
        ["body", "questions", "q", "instructions"],
    ),
    ({**REQUEST, "questions": {"q": {**NOUL, "criteria": "yes"}}}, ["body", "questions", "q", "criteria"]),
    (
        {**REQUEST, "questions": {"q": {**NOUL, "criteria": {"maybe": "x"}}}},
        ["body", "questions", "q", "criteria"],
    ),
    (
        {**REQUEST, "questions": {"q": {**CHOICE, "criteria": ["a", "b"]}}},
        ["body", "questions", "q", "criteria"],
    ),
    (
        {**REQUEST, "questions": {"q": {**CHOICE, "criteria": {"a": 1, "b": None}}}},
        ["body", "questions", "q", "criteria", "a"],
    ),
    ({**REQUEST, "questions": {"q": {"type": "choice"}}}, ["body", "questions", "q", "criteria"]),
    (
        {**REQUEST, "questions": {"q": {**SCORE, "criteria": {"0": "a", "1": "b"}}}},
        ["body", "questions", "q", "criteria"],
    ),
    (
        {**REQUEST, "questions": {"q": {**SCORE, "criteria": ["a", None]}}},
        ["body", "questions", "q", "criteria", 1],
    ),
    (
        {**REQUEST, "questions": {"q": {**SCORE, "criteria": ["a", 2]}}},
        ["body", "questions", "q", "criteria", 1],
    ),
    ({**REQUEST, "questions": {"": NOUL}}, ["body", "questions"]),
]
