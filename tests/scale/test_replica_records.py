"""The records a model replica sends the ingress through Ray, pickled whole (no Ray cluster here: the
deployment classes are plain classes until ``serve.deployment`` wraps them): its description (the engine's
card, heads and report), which the ingress's engine then exposes as it came, and its answers."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from clef_runtime.engine.clef import Clef
from clef_runtime.engine.contract import ReplicaReport
from clef_runtime.engine.decision import Decision
from clef_runtime.engine.loop import QueueTimeoutError
from clef_runtime.scale.ray_serve import ClefModel, IngressEngine, ReplicaAnswer, ReplicaReports
from clef_runtime.server.settings import ServerSettings


class Outcome:
    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


def _through_ray(value: Any) -> Any:
    """What the other end of a Ray call gets: a pickled copy."""
    return pickle.loads(pickle.dumps(value))


def test_the_ingress_describes_the_model_with_the_replicas_card(tiny: Clef) -> None:
    replica = object.__new__(ClefModel)
    replica.engine = tiny
    replica.replica_id = "r1"
    description = replica.describe()
    copy = _through_ray(description)
    assert copy == description and copy.card == tiny.card

    handle = SimpleNamespace(describe=SimpleNamespace(remote=lambda: Outcome(copy)))
    reports = ReplicaReports()
    ingress = IngressEngine(ServerSettings(model="tiny"), handle, reports)
    assert ingress.card == tiny.card
    assert (ingress.name, ingress.step_tokens) == (tiny.name, tiny.step_tokens)
    assert ingress.head_infos() == tiny.head_infos()
    assert [report.replica for report in reports.running({"r1"})] == ["r1"]


def test_a_replica_answer_round_trips() -> None:
    report = ReplicaReport("r1", 7, {"hits": 2})
    decision = Decision(model="m", answers={"q": {"type": "noul", "noul": 0.5}}, input_tokens=3, replica="r1")
    answered = _through_ray(ReplicaAnswer(report, decision=decision))
    assert answered.report == report and answered.outcome() == decision

    timed_out = _through_ray(ReplicaAnswer(report, timeout=(1.5, 1.0, 2.0)))
    with pytest.raises(QueueTimeoutError) as info:
        timed_out.outcome()
    assert (info.value.waited_s, info.value.timeout_s, info.value.retry_after_s) == (1.5, 1.0, 2.0)


def test_a_replica_answer_is_a_decision_or_a_timeout() -> None:
    report = ReplicaReport("r1", 7, {})
    with pytest.raises(ValueError, match="either"):
        ReplicaAnswer(report)
    decision = Decision(model="m", answers={}, input_tokens=1)
    with pytest.raises(ValueError, match="either"):
        ReplicaAnswer(report, decision=decision, timeout=(1.0, 1.0, 1.0))
