"""`Clef.decide_settled`: a request the engine fails on fails alone; the others of its batch are answered,
as `decide_encoded` answers them, where `decide_encoded` raises the failure."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from clef_runtime.engine.clef import Clef
from clef_runtime.engine.decision import Decision


def _requests() -> list[dict[str, Any]]:
    return [
        {"state": f"{word} ticket", "questions": {"q": {"type": "noul"}}}
        for word in ("first", "poison", "third")
    ]


def _poisoned(clef: Clef) -> Any:
    """The executor's admit, failing any batch that holds the request about the poison ticket (the loop then
    retries the rows one by one, and only that one keeps failing)."""
    admit = clef.executor.admit

    def admit_unless_poisoned(items: Any, **kwargs: Any) -> Any:
        if any("poison" in str(item.request.state) for item in items):
            raise ValueError("this row cannot run")
        return admit(items, **kwargs)

    return mock.patch.object(clef.executor, "admit", side_effect=admit_unless_poisoned)


def test_one_failing_request_fails_alone() -> None:
    clef = Clef.load("tiny", dtype="fp32")
    expected = [clef.decide(request) for request in _requests()]
    with _poisoned(clef):
        outcomes = clef.decide_settled([clef.prepare(request) for request in _requests()])
    assert isinstance(outcomes[1], ValueError)
    answered = [outcomes[0], outcomes[2]]
    assert all(isinstance(outcome, Decision) for outcome in answered)
    assert [o.body()["answers"] for o in answered] == [expected[0]["answers"], expected[2]["answers"]]  # type: ignore[union-attr]
    # The negative control: decide_encoded, on the same batch, raises the failure.
    with _poisoned(clef), pytest.raises(ValueError, match="cannot run"):
        clef.decide_encoded([clef.prepare(request) for request in _requests()])
