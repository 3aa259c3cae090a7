"""A fake engine that shows what reached it of ``x_explain``: it records the option of every request it
answers and, when the option is on, gives each answer an ``x_evidence`` list and the body an ``x_explain``
record of the wire's shape (made-up spans: the first ``top_k`` words of the rendered state). The routes'
tests use it to prove the option goes in and the evidence comes back out, without the real method."""

from __future__ import annotations

import re
from typing import Any

from devtools.fake_engine import FakeClef, FakeRecord, _render

from clef_runtime.engine.decision import Decision
from clef_runtime.engine.head_records import HeadIdentity
from clef_runtime.protocol.explain import ExplainOptions
from clef_runtime.protocol.systemone import SystemOneRequest

FAKE_METHOD = "fake-first-words"


def fake_evidence(state_text: str, top_k: int) -> list[dict[str, Any]]:
    """The first ``top_k`` words of the state as spans, weights falling from 1."""
    words = list(re.finditer(r"\w+", state_text))[:top_k]
    return [
        {"text": m.group(), "start": m.start(), "end": m.end(), "weight": round(1.0 / (i + 1), 4)}
        for i, m in enumerate(words)
    ]


class ExplainingEngine(FakeClef):
    """`FakeClef` that records ``x_explain`` (``explained``: one entry per answered request, None when off)
    and answers it with made-up evidence."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.explained: list[ExplainOptions | None] = []

    def _answer(
        self, request: SystemOneRequest, record: FakeRecord, head: HeadIdentity | None = None
    ) -> Decision:
        decision = super()._answer(request, record, head)
        options = request.x_explain
        self.explained.append(options)
        if options is None:
            return decision
        state_text = _render(request.state)
        evidence = fake_evidence(state_text, options.top_k)
        answers = {qid: {**answer, "x_evidence": evidence} for qid, answer in decision.answers.items()}
        record_ = {
            "method": FAKE_METHOD,
            "granularity": options.granularity,
            "top_k": options.top_k,
            "weights": "made up by the test engine",
            "state_text": state_text,
        }
        return Decision(
            model=decision.model,
            answers=answers,
            input_tokens=decision.input_tokens,
            head=decision.head,
            explanation=record_,
        )
