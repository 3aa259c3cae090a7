"""The status page's request counts (a client's 4xx is a rejected request, only a 5xx is a server error), and
the decision metrics: answers by model, head, classifier and type, confidence, near ties, truncated tokens,
and the fused kernels' status, on /metrics and /status.json alike."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest
from devtools.fake_engine import FAIL_MARKER, FakeClef, FakeRecord, schema_tokens
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from clef_runtime.engine.decision import Decision
from clef_runtime.engine.head_records import HeadIdentity
from clef_runtime.protocol.systemone import SystemOneRequest, parse_request
from clef_runtime.server.answer_metrics import (
    MAX_CLASSIFIER_LABELS,
    OTHER_CLASSIFIERS,
    AnswerMetrics,
    fused_kernels_of,
)
from clef_runtime.server.metrics import RecentRequests, ServerMetrics
from tests.server.conftest import Served
from tests.server.helpers import CHOICE, NOUL, REQUEST, SCORE, post, wait_for


def test_4xx_are_rejected_and_only_5xx_are_errors() -> None:
    recent = RecentRequests()
    for status in (200, 201, 400, 401, 404, 413, 422, 429, 500, 503):
        recent.add(status, 0.01)
    summary = recent.summary()
    assert (summary["total"], summary["rejected"], summary["errors"], summary["window"]) == (10, 6, 2, 2)


def test_status_json_counts_client_refusals_apart_from_server_failures(
    serve_fake: Callable[..., Served],
) -> None:
    client = serve_fake(max_body_bytes=4096).client
    assert post(client, REQUEST).status_code == 200
    assert post(client, {"state": "x", "questions": {}}).status_code == 422
    assert post(client, b'{"state": "' + b"a" * 5000 + b'"}').status_code == 413
    assert post(client, {**REQUEST, "state": FAIL_MARKER}).status_code == 500
    requests = client.get("/status.json").json()["requests"]
    assert (requests["total"], requests["rejected"], requests["errors"], requests["window"]) == (4, 2, 1, 1)


# ------------------------------------------------------------------------------------------ decision metrics

TIE = "a near tie"
"""A state the `SetAnswers` engine answers with a near tie on every question."""


class SetAnswers(FakeClef):
    """Answers every question with set probabilities (reported unrounded, as the real engine does): a near
    tie (noul 0.51, a choice 0.51 / 0.49, a score's top two 0.41 / 0.39) when the state holds `TIE`, a clear
    answer (0.9 / 0.1, or 0.8 on a score's top level) otherwise."""

    def _answer(
        self, request: SystemOneRequest, record: FakeRecord, head: HeadIdentity | None = None, images: int = 0
    ) -> Decision:
        tie = TIE in json.dumps(request.state)
        answers: dict[str, Any] = {}
        probabilities: list[list[float]] = []
        for qid, question in request.questions.items():
            if question.type == "noul":
                p = 0.51 if tie else 0.9
                answers[qid] = {"type": "noul", "noul": p}
                probabilities.append([1 - p, p])
                continue
            count = len(question.criteria)
            top, second = (
                (0.41, 0.39) if tie and question.type == "score" else (0.51, 0.49) if tie else (0.8, 0.1)
            )
            rest = (1 - top - second) / (count - 2) if count > 2 else 0.0
            probs = [top, second, *[rest] * (count - 2)] if count > 2 else [top, 1 - top]
            keys = (
                [str(k) for k in question.criteria]
                if question.type == "choice"
                else [str(i) for i in range(count)]
            )
            answers[qid] = {"type": question.type, "probabilities": dict(zip(keys, probs, strict=True))}
            probabilities.append(probs)
        return Decision(
            model=request.model or self.name,
            answers=answers,
            input_tokens=record.input_tokens,
            head=head,
            probabilities=probabilities,
        )


def metric(client: TestClient, name: str, **labels: str) -> float:
    """The value of the /metrics sample ``name`` with exactly ``labels`` (0 when there is none)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def answers_of(client: TestClient, classifier: str, kind: str, name: str = "clef_answers_total") -> float:
    return metric(client, name, model="fake-clef", head="fake-clef", classifier=classifier, type=kind)


@pytest.fixture
def set_answers(serve_fake: Callable[..., Served]) -> Served:
    return serve_fake(SetAnswers())


def test_answers_are_counted_by_model_head_classifier_and_type(set_answers: Served) -> None:
    client = set_answers.client
    for _ in range(3):
        assert post(client, REQUEST).status_code == 200
    questions = {"refund": NOUL, "team": CHOICE, "urgency": SCORE, "again": NOUL}
    assert client.put("/v1/classifiers/triage", json={"questions": questions}).status_code in (200, 201)
    for _ in range(2):
        assert client.post("/v1/classifiers/triage/decide", json={"state": "s"}).status_code == 200
    # The request's free-text model names no head: the default head answers, and labels it.
    assert post(client, {**REQUEST, "model": "anything at all"}).status_code == 200

    assert [answers_of(client, "", kind) for kind in ("noul", "choice", "score")] == [4, 4, 4]
    assert [answers_of(client, "triage", kind) for kind in ("noul", "choice", "score")] == [4, 2, 2]
    counts = [
        answers_of(client, classifier, kind, "clef_answer_confidence_count")
        for classifier in ("", "triage")
        for kind in ("noul", "choice", "score")
    ]
    assert sum(counts) == 4 * 3 + 2 * 4  # one observation per answered question
    text = client.get("/metrics").text
    assert "anything at all" not in text  # never a request's free text as a label
    # Every answer here is clear: its confidence is the top probability, above the near-tie margin.
    assert answers_of(client, "", "noul", "clef_answer_confidence_sum") == pytest.approx(4 * 0.9)
    assert answers_of(client, "", "noul", "clef_near_ties_total") == 0


def test_a_near_tie_is_counted_and_a_clear_answer_is_not(set_answers: Served) -> None:
    client = set_answers.client
    tie = {**REQUEST, "state": TIE}
    assert post(client, tie).status_code == 200
    assert [answers_of(client, "", kind, "clef_near_ties_total") for kind in ("noul", "choice", "score")] == [
        1,
        1,
        1,
    ]
    assert post(client, REQUEST).status_code == 200  # clear: no near tie
    assert [answers_of(client, "", kind, "clef_near_ties_total") for kind in ("noul", "choice", "score")] == [
        1,
        1,
        1,
    ]
    assert answers_of(client, "", "noul") == 2


def test_an_engine_without_unrounded_probabilities_is_read_from_its_answers(
    serve_fake: Callable[..., Served],
) -> None:
    client = serve_fake().client  # the plain fake engine reports no probabilities
    body = {"state": "x", "questions": {"refund": NOUL, "team": CHOICE}}
    answers = post(client, body).json()["answers"]
    noul = answers["refund"]["noul"]
    assert answers_of(client, "", "noul", "clef_answer_confidence_sum") == pytest.approx(max(noul, 1 - noul))
    confidence = answers["team"]["confidence"]
    assert answers_of(client, "", "choice", "clef_answer_confidence_sum") == pytest.approx(confidence)


def test_truncation_counts_the_requests_and_the_state_tokens_dropped(
    serve_fake: Callable[..., Served],
) -> None:
    client = serve_fake(max_input_tokens=100).client
    body: dict[str, Any] = {"state": "", "questions": {"q": NOUL}}
    fixed = schema_tokens(parse_request(body))
    dropped = []
    for over in (7, 30):
        body["state"] = " ".join(["w"] * (100 - fixed + over))
        dropped.append(post(client, body).json()["x_truncated_state_tokens"])
    body["state"] = "short"
    assert post(client, body).json()["x_truncated_state_tokens"] == 0
    assert dropped == [7, 30]
    assert metric(client, "clef_truncated_state_tokens_total") == 37
    assert metric(client, "clef_truncated_requests_total") == 2


def test_a_batch_jobs_answers_are_counted(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake(SetAnswers()).client
    rows = [{"custom_id": f"c{i}", "state": TIE, "questions": {"q": NOUL}} for i in range(3)]
    created = client.post("/v1/jobs", content="\n".join(json.dumps(row) for row in rows) + "\n")
    assert created.status_code == 202
    wait_for(lambda: answers_of(client, "", "noul", "clef_near_ties_total") == 3)
    assert answers_of(client, "", "noul") == 3


def test_the_fused_kernels_are_off_on_cpu_and_say_why(serve_fake: Callable[..., Served]) -> None:
    client = serve_fake().client
    assert metric(client, "clef_fused_kernels", device="cpu", reason="cpu") == 0
    assert "clef_fused_kernels{" in client.get("/metrics").text
    cpu = {"in_use": False, "device": "cpu", "reason": "cpu", "calls": None, "conv": None}
    assert client.get("/status.json").json()["fused_kernels"] == cpu
    assert client.get("/ready").json()["fused_kernels"] == cpu
    assert client.get("/v1/models").json()["data"][0]["fused_kernels"] == cpu


class CountedCalls:
    """A stand-in for `clef_runtime.model.fused.fused_kernels_status`: which of the four DeltaNet functions
    have a fused implementation in place, and the calls counted so far (set by the test as it goes)."""

    def __init__(self, active: bool = True, fused: int = 0, reference: int = 0, conv: str = "fla") -> None:
        self.active, self.fused, self.reference, self.conv = active, fused, reference, conv

    def __call__(self) -> dict[str, Any]:
        names = ("causal_conv1d_fn", "causal_conv1d_update", "chunk", "recurrent")
        # The counts spread over two functions: the status sums them.
        calls = {name: {"fused": 0, "reference": 0} for name in names}
        calls["chunk"] = {"fused": self.fused - self.fused // 2, "reference": self.reference // 2}
        calls["causal_conv1d_fn"] = {
            "fused": self.fused // 2,
            "reference": self.reference - self.reference // 2,
        }
        return {"active": dict.fromkeys(names, self.active), "conv": self.conv, "calls": calls}


def _broken() -> dict[str, Any]:
    raise ImportError("no transformers")


@pytest.mark.parametrize(
    ("device", "enabled", "status", "reason", "calls"),
    [
        ("cuda:0", True, CountedCalls(fused=40), "in_use", {"fused": 40, "reference": 0}),
        ("cuda:0", True, CountedCalls(fused=20, reference=20), "partial", {"fused": 20, "reference": 20}),
        ("cuda:0", True, CountedCalls(reference=40), "fallback", {"fused": 0, "reference": 40}),
        ("cuda:0", True, CountedCalls(False, reference=40), "not_installed", {"fused": 0, "reference": 40}),
        ("cuda:0", True, CountedCalls(False), "not_installed", {"fused": 0, "reference": 0}),
        ("cuda:0", True, CountedCalls(), "no_calls", {"fused": 0, "reference": 0}),
        # Installed and even called before, but turned off: off, with the counts.
        ("cuda:0", False, CountedCalls(fused=4, reference=40), "disabled", {"fused": 4, "reference": 40}),
        ("cuda:0", True, _broken, "unknown", None),
        ("cuda:0", False, _broken, "disabled", None),
        ("cpu", True, CountedCalls(fused=40), "cpu", None),
    ],
)
def test_the_fused_kernel_status_comes_from_the_calls_counted(
    device: str,
    enabled: bool,
    status: Callable[[], dict[str, Any]],
    reason: str,
    calls: dict[str, int] | None,
) -> None:
    card = FakeClef().card
    card = dataclasses.replace(
        card, device=device, options=dataclasses.replace(card.options, fused_kernels=enabled)
    )
    fused = fused_kernels_of(card, status)
    assert (fused.in_use, fused.device, fused.reason, fused.calls) == (
        reason == "in_use",
        device,
        reason,
        calls,
    )
    assert fused.conv == ("fla" if calls is not None else None)


def test_model_replicas_status_is_not_read_from_this_process() -> None:
    """Under ``--ray`` the model (and its counts) live in the replicas: the ingress does not pass its own
    zero counts off as theirs."""
    card = dataclasses.replace(FakeClef().card, device="cuda:0")
    fused = fused_kernels_of(card, CountedCalls(fused=40), in_process=False)
    assert (fused.in_use, fused.reason, fused.calls) == (False, "replicas", None)


def test_ready_models_metrics_and_status_read_the_counts_live(
    serve_fake: Callable[..., Served], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA every endpoint says what the calls counted say when it is asked, not what they said at load:
    no calls yet, then reference calls only (the fallback), then fused calls."""
    from clef_runtime.model import fused

    counted = CountedCalls()
    monkeypatch.setattr(fused, "fused_kernels_status", counted)
    engine = FakeClef()
    engine.card = dataclasses.replace(engine.card, device="cuda:0")
    client = serve_fake(engine).client

    def said() -> list[dict[str, Any]]:
        return [
            client.get("/ready").json()["fused_kernels"],
            client.get("/v1/models").json()["data"][0]["fused_kernels"],
            client.get("/status.json").json()["fused_kernels"],
        ]

    def gauge() -> dict[str, float]:
        text = client.get("/metrics").text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        # One series at a time, labelled by the device and the reason now.
        return {s.labels["reason"]: s.value for s in samples if s.name == "clef_fused_kernels"}

    for fused_calls, reference_calls, reason in ((0, 0, "no_calls"), (0, 64, "fallback"), (96, 0, "in_use")):
        counted.fused, counted.reference = fused_calls, reference_calls
        expected = {
            "in_use": reason == "in_use",
            "device": "cuda:0",
            "reason": reason,
            "calls": {"fused": fused_calls, "reference": reference_calls},
            "conv": "fla",
        }
        assert said() == [expected] * 3
        assert gauge() == {reason: 1.0 if reason == "in_use" else 0.0}


def test_status_json_shows_per_classifier_what_metrics_shows(set_answers: Served) -> None:
    client = set_answers.client
    assert client.put("/v1/classifiers/triage", json={"questions": {"q": NOUL}}).status_code in (200, 201)
    assert client.post("/v1/classifiers/triage/decide", json={"state": TIE}).status_code == 200
    assert client.post("/v1/classifiers/triage/decide", json={"state": "clear"}).status_code == 200
    assert post(client, REQUEST).status_code == 200
    rows = client.get("/status.json").json()["answers"]
    assert [row["classifier"] for row in rows] == [None, "triage"]
    for row in rows:
        label = row["classifier"] or ""
        kinds = ("noul", "choice", "score")
        assert row["answers"] == sum(answers_of(client, label, kind) for kind in kinds)
        assert row["near_ties"] == sum(
            answers_of(client, label, kind, "clef_near_ties_total") for kind in kinds
        )
        total = sum(answers_of(client, label, kind, "clef_answer_confidence_sum") for kind in kinds)
        assert row["mean_confidence"] == pytest.approx(total / row["answers"], abs=1e-4)
    assert (rows[1]["answers"], rows[1]["near_ties"], rows[1]["mean_confidence"]) == (2, 1, 0.705)


def test_classifier_names_past_the_bound_share_one_label() -> None:
    metrics = ServerMetrics()
    decisions: AnswerMetrics = metrics.decisions
    decision = Decision(model="m", answers={"q": {"type": "noul", "noul": 0.9}}, input_tokens=1)
    for i in range(MAX_CLASSIFIER_LABELS + 5):
        decisions.observe(decision, f"c{i}")
    decisions.observe(decision, "c0")  # a name already labelled keeps its label
    names = [row["classifier"] for row in decisions.summary()]
    assert len(names) == MAX_CLASSIFIER_LABELS + 1 and names.count(OTHER_CLASSIFIERS) == 1
    by_name = {row["classifier"]: row["answers"] for row in decisions.summary()}
    assert (by_name["c0"], by_name[OTHER_CLASSIFIERS]) == (2, 5)
