"""``answer_url`` against a scripted stub server (standard library, no model): a busy answer (429) is
retried, a refused case is a failure carrying the server's message, a refused key stops the run, and a
response that is not System One is named."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from clef_runtime.cli import main
from clef_runtime.evaluation.cases import parse_cases
from clef_runtime.evaluation.runner import RemoteError, answer_url, systemone_url
from tests.helpers import JsonHandler, stub_server

QUESTIONS = {"spam": {"type": "noul"}, "team": {"type": "choice", "criteria": {"b": None, "a": None}}}
ANSWERS = {
    "spam": {"type": "noul", "noul": 0.8},
    "team": {"type": "choice", "choice": "a", "confidence": 0.7, "probabilities": {"b": 0.3, "a": 0.7}},
}


class Stub(JsonHandler):
    """Answers by the case's state: ``busy-once`` gets a 429 first, ``bad`` a 422, ``garbage`` no answers."""

    seen: ClassVar[list[str]] = []
    key: ClassVar[str | None] = None
    owner: ClassVar[str] = "cloudflare"

    def do_GET(self) -> None:
        if self.key and self.headers.get("Authorization") != f"Bearer {self.key}":
            return self.reply(401, {"detail": {"error_type": "authentication_error", "message": "bad key"}})
        entry = {"id": "stub", "owned_by": self.owner, "x_calibration": {"label": "c.json@sha256:0"}}
        self.reply(200, {"object": "list", "data": [entry]})

    def do_POST(self) -> None:
        body = json.loads(self.body())
        state = body["state"]
        self.seen.append(state)
        if state == "busy-once" and self.seen.count(state) == 1:
            return self.reply(429, {"detail": {"error_type": "queue_full", "message": "busy"}})
        if state == "bad":
            return self.reply(422, {"detail": [{"loc": ["body", "state"], "msg": "too odd", "type": "x"}]})
        if state == "garbage":
            return self.reply(200, {"model": "stub"})
        self.reply(
            200, {"model": "stub", "answers": ANSWERS, "usage": {"input_tokens": 1, "output_tokens": 0}}
        )


@pytest.fixture
def stub() -> Iterator[str]:
    Stub.seen, Stub.key, Stub.owner = [], None, "cloudflare"
    with stub_server(Stub) as url:
        yield url


def cases(*states: str) -> list[Any]:
    lines = [
        json.dumps({"id": s, "state": s, "questions": QUESTIONS, "expected": {"team": "a"}}) for s in states
    ]
    return parse_cases(lines)


def test_busy_is_retried_and_refusals_are_failures(stub: str) -> None:
    result = answer_url(stub, cases("ok", "busy-once", "bad", "garbage"), concurrency=2)
    assert [a.case.id for a in result.answered] == ["ok", "busy-once"]
    assert Stub.seen.count("busy-once") == 2
    failures = {case.id: message for case, message in result.failures}
    assert failures["bad"] == "HTTP 422: state: too odd"
    assert failures["garbage"].startswith("not a System One response")
    assert result.source == {
        "kind": "url",
        "url": stub + "/v1/systemone",
        "model": "stub",
        "untrained": False,
        "calibration": "c.json@sha256:0",
        "rounded": True,
    }
    team = next(o for o in result.answered[0].outcomes if o.question_id == "team")
    assert team.options == ("b", "a") and list(team.probs) == [0.3, 0.7] and team.expected == 1
    spam = next(o for o in result.answered[0].outcomes if o.question_id == "spam")
    assert list(spam.probs) == pytest.approx([0.8, 0.2]) and spam.expected is None


def test_a_server_of_an_untrained_model_is_marked_untrained(stub: str) -> None:
    # The server lists its own untrained tiny model as clef-runtime's, a release as Cloudflare's.
    assert answer_url(stub, cases("ok")).source["untrained"] is False
    Stub.owner = "clef-runtime"
    assert answer_url(stub, cases("ok")).source["untrained"] is True


def test_refused_key_stops_the_run(stub: str) -> None:
    Stub.key = "right"
    with pytest.raises(RemoteError, match="refused the API key"):
        answer_url(stub, cases("ok"), api_key="wrong")
    assert answer_url(stub, cases("ok"), api_key="right").answered
    assert Stub.seen == ["ok"]


def test_cli_lists_unanswered_cases_and_exits_1(
    stub: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cases.jsonl"
    path.write_text(
        "\n".join(json.dumps(c.body | {"id": c.id, "expected": {"team": "a"}}) for c in cases("ok", "bad"))
    )
    assert main(["eval", str(path), "--url", stub, "--json", str(tmp_path / "m.json")]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: case bad: not answered: HTTP 422: state: too odd" in err
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["overall"]["n"] == 1 and metrics["failures"] == [
        {"line": 2, "id": "bad", "error": "HTTP 422: state: too odd"}
    ]


def test_systemone_url_forms() -> None:
    assert systemone_url("http://h:1") == "http://h:1/v1/systemone"
    assert systemone_url("http://h:1/") == "http://h:1/v1/systemone"
    assert systemone_url("https://h/v1/systemone") == "https://h/v1/systemone"
    assert systemone_url("http://h/proxy") == "http://h/proxy/v1/systemone"
    with pytest.raises(RemoteError, match="not an http"):
        systemone_url("h:1")
