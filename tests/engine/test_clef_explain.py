"""``Clef.decide(request, explain=...)`` and ``decide_many``: ``explain`` sets the request's ``x_explain``
(a body dict or a parsed request), validated as the wire field is. The engine's part (the evidence itself)
is tested with the method; here a stand-in records what `Clef.prepare` receives."""

from __future__ import annotations

from typing import Any

import pytest

from clef_runtime.engine.clef import Clef, with_explain
from clef_runtime.engine.decision import Decision
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.explain import ExplainOptions
from clef_runtime.protocol.systemone import parse_request
from tests.helpers import MINIMAL_REQUEST


class _Recorder:
    """What `Clef.decide` calls on ``self``: ``prepare`` records the request, ``decide_encoded`` answers."""

    def __init__(self) -> None:
        self.prepared: list[Any] = []

    def prepare(self, request: Any) -> Any:
        self.prepared.append(request)
        return request

    def decide_encoded(self, items: list[Any]) -> list[Decision]:
        return [Decision(model="m", answers={}, input_tokens=1) for _ in items]


@pytest.mark.parametrize(
    ("explain", "wire"),
    [
        (True, {"top_k": 5, "granularity": "word"}),
        ({"top_k": 3}, {"top_k": 3, "granularity": "word"}),
        (ExplainOptions(top_k=2, granularity="field"), {"top_k": 2, "granularity": "field"}),
    ],
)
def test_explain_sets_the_bodys_x_explain(explain: Any, wire: dict[str, Any]) -> None:
    engine = _Recorder()
    Clef.decide(engine, dict(MINIMAL_REQUEST), explain=explain)  # type: ignore[arg-type]
    (sent,) = engine.prepared
    assert sent["x_explain"] == wire
    assert parse_request(sent).x_explain == ExplainOptions(**wire)
    assert {k: v for k, v in sent.items() if k != "x_explain"} == MINIMAL_REQUEST


def test_without_explain_the_request_is_left_as_it_is_and_false_turns_it_off() -> None:
    asked = {**MINIMAL_REQUEST, "x_explain": True}
    engine = _Recorder()
    Clef.decide(engine, asked)  # type: ignore[arg-type]
    Clef.decide(engine, asked, explain=False)  # type: ignore[arg-type]
    assert engine.prepared[0] is asked
    assert "x_explain" not in engine.prepared[1]


def test_explain_sets_a_parsed_requests_option() -> None:
    parsed = parse_request(dict(MINIMAL_REQUEST))
    assert with_explain(parsed, {"granularity": "token"}).x_explain == ExplainOptions(granularity="token")
    assert parsed.x_explain is None  # the caller's request is not changed


def test_decide_many_sets_every_bodys_x_explain() -> None:
    engine = _Recorder()
    Clef.decide_many(engine, [dict(MINIMAL_REQUEST), dict(MINIMAL_REQUEST)], explain=True)  # type: ignore[arg-type]
    assert [body["x_explain"]["top_k"] for body in engine.prepared] == [5, 5]


@pytest.mark.parametrize(
    ("explain", "loc"),
    [
        ({"top_k": 0}, ("x_explain", "top_k")),
        ({"granularity": "line"}, ("x_explain", "granularity")),
        ("yes", ("x_explain",)),
    ],
)
def test_a_bad_explain_is_a_validation_error_naming_the_field(explain: Any, loc: tuple[Any, ...]) -> None:
    engine = _Recorder()
    with pytest.raises(RequestValidationError) as caught:
        Clef.decide(engine, dict(MINIMAL_REQUEST), explain=explain)  # type: ignore[arg-type]
    assert [error["loc"] for error in caught.value.errors] == [loc]
    assert engine.prepared == []
