"""Bad text and numbers over HTTP: 422 naming the field before any engine work, on both decision routes; the
413 for a streamed body says how large it got."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.server.conftest import Served

NOUL = {"q": {"type": "noul"}}
PREDICATE = [{"type": "predicate", "instructions": "?"}]

# Raw JSON text: "\ud800" is how a client sends a lone surrogate; 1e400 parses to inf.
CASES: list[tuple[str, str, list[Any]]] = [
    ("/v1/systemone", '{"state": "\\ud800", "questions": {"q": {"type": "noul"}}}', ["body", "state"]),
    (
        "/v1/systemone",
        '{"state": {"a\\ud800": 1}, "questions": {"q": {"type": "noul"}}}',
        ["body", "state", "a\\ud800"],
    ),
    (
        "/v1/systemone",
        '{"model": "\\ud800", "state": "s", "questions": {"q": {"type": "noul"}}}',
        ["body", "model"],
    ),
    (
        "/v1/systemone",
        '{"state": "s", "questions": {"\\udc00": {"type": "noul"}}}',
        ["body", "questions", "\\udc00"],
    ),
    (
        "/v1/systemone",
        '{"state": "s", "questions": {"q": {"type": "choice", "criteria": {"\\ud800": null, "b": null}}}}',
        ["body", "questions", "q", "criteria", "\\ud800"],
    ),
    (
        "/v1/systemone",
        '{"state": {"n": 1e400}, "questions": {"q": {"type": "noul"}}}',
        ["body", "state", "n"],
    ),
    ("/v1/systemone", '{"state": [1, -1e999], "questions": {"q": {"type": "noul"}}}', ["body", "state", 1]),
    (
        "/v1/decisions",
        '{"input": "\\ud800", "questions": [{"type": "predicate", "instructions": "?"}]}',
        ["body", "input"],
    ),
    (
        "/v1/decisions",
        '{"model": "\\ud800", "input": "x", "questions": [{"type": "predicate", "instructions": "?"}]}',
        ["body", "model"],
    ),
    (
        "/v1/decisions",
        '{"input": "x", "questions": [{"type": "predicate", "instructions": "?", "name": "\\ud800"}]}',
        ["body", "questions", 0, "name"],
    ),
    (
        "/v1/decisions",
        '{"input": [{"role": "user", "content": [{"type": "input_json", "data": {"n": 1e400}}]}], '
        '"questions": [{"type": "predicate", "instructions": "?"}]}',
        ["body", "input", 0, "content", 0, "data", "n"],
    ),
]


@pytest.mark.parametrize(("path", "raw", "loc"), CASES, ids=range(len(CASES)))
def test_bad_text_or_numbers_are_422_naming_the_field_before_the_engine_runs(
    serve_fake: Callable[..., Served], path: str, raw: str, loc: list[Any]
) -> None:
    served = serve_fake()
    response = served.client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert [item["loc"] for item in detail] == [loc]
    assert detail[0]["type"] in ("invalid_text", "invalid_json_value")
    assert served.engine.batches == []  # no model work was done
    ok = (
        {"state": "s", "questions": NOUL}
        if path == "/v1/systemone"
        else {"input": "s", "questions": PREDICATE}
    )
    assert served.client.post(path, json=ok).status_code == 200


def test_a_streamed_body_over_the_limit_says_how_large_it_got(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(max_body_bytes=4096).client
    body = json.dumps({"state": "a" * 10_000, "questions": NOUL}).encode()
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))  # no Content-Length: chunked
    response = client.post("/v1/systemone", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413
    message = response.json()["detail"]["message"]
    assert "  " not in message
    # What had been read when reading stopped (the test client may merge chunks), and the limit.
    received = re.search(r"reached (\d+) bytes", message)
    assert received is not None and 4096 < int(received.group(1)) <= len(body), message
    assert "limit of 4096 bytes" in message
    declared = client.post("/v1/systemone", content=body, headers={"content-type": "application/json"})
    assert f"{len(body)} bytes" in declared.json()["detail"]["message"]
