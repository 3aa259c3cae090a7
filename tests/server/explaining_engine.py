"""A fake engine that shows what reached it of ``x_explain``: it records the option of every request it
answers (``explained``), and answers with `FakeClef`'s own made-up evidence of the wire's shape. The routes'
tests use it to prove the option goes in and the evidence comes back out, without the real method."""

from __future__ import annotations

from typing import Any

from devtools.fake_engine import FAKE_EXPLAIN_METHOD, FakeClef, FakeRecord

from clef_runtime.engine.decision import Decision
from clef_runtime.protocol.explain import ExplainOptions
from clef_runtime.protocol.systemone import SystemOneRequest

FAKE_METHOD = FAKE_EXPLAIN_METHOD


class ExplainingEngine(FakeClef):
    """`FakeClef` that records ``x_explain`` (``explained``: one entry per answered request; None: off)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.explained: list[ExplainOptions | None] = []

    def _answer(self, request: SystemOneRequest, record: FakeRecord, *rest: Any) -> Decision:
        self.explained.append(request.x_explain)
        return super()._answer(request, record, *rest)
