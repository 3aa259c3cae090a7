"""``x_explain`` in the engine (`clef_runtime.engine.explain` and the executor's hook) on the tiny model: the
evidence is spans of the rendered state (never of the schema) or image patches, at most ``top_k`` per
answer, for the answer given; nothing runs without ``x_explain``. The method itself is tested in
tests/model/test_attribution.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from clef_runtime.encoding.render import render
from clef_runtime.engine import executor, explain
from clef_runtime.engine.clef import Clef
from clef_runtime.engine.explain import answer_targets
from clef_runtime.model.attribution import AttributionTarget, row_attributions
from clef_runtime.options import EXPLAIN_METHODS, EngineOptions, OptionsError
from tests.engine.test_clef import EXAMPLE, variant
from tests.helpers import png_data_url

TICKET = "Charged twice for my March invoice, please refund today.\nThe card ends in 4242."
TEAMS = {"billing": "payments", "tech": "outages", "sales": None}
QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Is a refund requested?"},
    "team": {"type": "choice", "instructions": "Which department should handle this?", "criteria": TEAMS},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["later", "soon", "now"]},
}
#: Words of the questions and options that the state does not hold: never evidence.
SCHEMA_WORDS = {"requested", "department", "handle", "billing", "payments", "outages", "sales", "urgent"}


def ask(state: Any, **extra: Any) -> dict[str, Any]:
    return {"state": state, "questions": QUESTIONS, **extra}


def text_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [item for answer in body["answers"].values() for item in answer["x_evidence"] if "text" in item]


def resolve(value: Any, pointer: str) -> tuple[str, Any]:
    """The last reference token of an RFC 6901 ``pointer`` and the value it points to in ``value``."""
    token = ""
    for raw in pointer.split("/")[1:]:
        token = raw.replace("~1", "/").replace("~0", "~")
        value = value[int(token)] if isinstance(value, list) else value[token]
    return token, value


def test_without_x_explain_nothing_is_explained_or_computed(
    tiny: Clef, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("attribution ran for a request without x_explain")

    monkeypatch.setattr(executor, "explain_row", refuse)
    monkeypatch.setattr(explain, "row_attributions", refuse)
    body = tiny.decide(ask(TICKET))
    assert "x_explain" not in body
    assert all("x_evidence" not in answer for answer in body["answers"].values())


@pytest.mark.parametrize("granularity", ["token", "word", "field"])
def test_text_evidence_is_spans_of_the_state_at_the_granularity(tiny: Clef, granularity: str) -> None:
    body = tiny.decide(ask(TICKET), explain={"top_k": 3, "granularity": granularity})
    assert body["x_explain"] == {
        "method": "integrated_gradients",
        "granularity": granularity,
        "top_k": 3,
        "weights": explain.WEIGHT_MEANINGS["integrated_gradients"],
    }  # a string state needs no state_text: it is its own rendering
    for answer in body["answers"].values():
        assert 1 <= len(answer["x_evidence"]) <= 3
    for item in text_items(body):
        assert set(item) == {"text", "start", "end", "weight"}  # no path for a string state
        assert 0 <= item["start"] < item["end"] <= len(TICKET)
        assert TICKET[item["start"] : item["end"]] == item["text"]
        assert not SCHEMA_WORDS & {word.lower() for word in re.findall(r"\w+", item["text"])}
        if granularity == "word":
            assert re.fullmatch(r"\w+", item["text"])
    if granularity == "field":
        # A text state's fields are its lines and sentences: never a part of a word.
        lines = {item["text"] for item in text_items(body)}
        assert all(len(text.split()) > 1 for text in lines)


def test_json_evidence_carries_the_rendered_state_and_pointers(tiny: Clef) -> None:
    state = EXAMPLE["state"]
    body = tiny.decide({**EXAMPLE, "x_explain": {"top_k": 20}})
    state_text = body["x_explain"]["state_text"]
    assert state_text == render(state)
    items = text_items(body)
    assert items
    for item in items:
        assert state_text[item["start"] : item["end"]] == item["text"]
        key, member = resolve(state, item["path"])
        # The span is the member's value or its key (a key's words are evidence of its member).
        assert item["text"] in render(member) or item["text"] in key


def test_field_evidence_of_a_json_state_is_its_leaves(tiny: Clef) -> None:
    state = EXAMPLE["state"]
    body = tiny.decide({**EXAMPLE, "x_explain": {"top_k": 20, "granularity": "field"}})
    items = text_items(body)
    assert {item["path"] for item in items} <= {"/ticket", "/customer/plan", "/customer/since"}
    for item in items:
        assert item["text"] == str(resolve(state, item["path"])[1])


def test_the_target_is_the_answer_given(tiny: Clef) -> None:
    prepared = tiny.prepare(ask(TICKET))
    order = prepared.record.questions
    model_order = {question.question_id: question.option_ids for question in order}

    def probabilities(refund_true: float, team: dict[str, float], levels: list[float]) -> list[list[float]]:
        by_question = {
            "refund": {"true": refund_true, "false": 1 - refund_true},
            "team": team,
            "urgency": {str(level): p for level, p in enumerate(levels)},
        }
        return [[by_question[q.question_id][o] for o in model_order[q.question_id]] for q in order]

    def answered(targets: list[AttributionTarget]) -> dict[str, str | None]:
        return {
            order[t.question].question_id: None
            if t.option is None
            else order[t.question].option_ids[t.option]
            for t in targets
        }

    tie = {"billing": 0.2, "tech": 0.4, "sales": 0.4}  # the first maximum in the request's order: tech
    assert answered(
        answer_targets(prepared.request, prepared.record, probabilities(0.5, tie, [0.2, 0.3, 0.5]))
    ) == {
        "refund": "true",
        "team": "tech",
        "urgency": None,
    }
    last = {"billing": 0.1, "tech": 0.2, "sales": 0.7}
    assert answered(
        answer_targets(prepared.request, prepared.record, probabilities(0.49, last, [1.0, 0.0, 0.0]))
    ) == {"refund": "false", "team": "sales", "urgency": None}


def test_the_decided_answers_are_the_targets(tiny: Clef, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[AttributionTarget]] = []

    def recording(*args: Any) -> Any:
        seen.append(list(args[5]))
        return row_attributions(*args)

    monkeypatch.setattr(explain, "row_attributions", recording)
    body = tiny.decide(ask(TICKET), explain=True)
    (targets,) = seen
    order = tiny.prepare(ask(TICKET)).record.questions
    answers = body["answers"]
    given = {order[t.question].question_id: order[t.question].option_ids[t.option] for t in targets[:2]}
    assert given == {
        "refund": "true" if answers["refund"]["noul"] >= 0.5 else "false",
        "team": answers["team"]["choice"],
    }
    assert targets[2] == AttributionTarget(2, None)


def test_a_truncated_state_is_explained_only_by_the_kept_text(tiny: Clef) -> None:
    long_state = " ".join(f"word{number}" for number in range(400))
    short = variant(tiny, max_length=400)  # the schema takes about 300
    prepared = short.prepare(ask(long_state))
    kept = prepared.record.state_end - prepared.record.state_start
    assert prepared.record.truncated_state_tokens > 0
    _, offsets = short.encoder.tokenizer.encode_with_offsets(long_state)
    kept_end = offsets[kept - 1][1]
    body = short.decide(ask(long_state), explain={"top_k": 20, "granularity": "token"})
    items = text_items(body)
    assert items
    assert max(item["end"] for item in items) <= kept_end < len(long_state)


def test_independent_questions_are_each_explained(tiny: Clef) -> None:
    body = tiny.decide(ask(TICKET, x_independent=True), explain={"top_k": 2})
    assert body["x_explain"]["top_k"] == 2
    for answer in body["answers"].values():
        assert 1 <= len(answer["x_evidence"]) <= 2
    for item in text_items(body):
        assert TICKET[item["start"] : item["end"]] == item["text"]


@pytest.mark.parametrize(("size", "granularity"), [((64, 48), "token"), ((400, 200), "field")])
def test_image_evidence_is_boxes_inside_the_image(
    tiny: Clef, size: tuple[int, int], granularity: str
) -> None:
    width, height = size
    request = {"state": "a", "images": [png_data_url(width, height, 1)], "questions": QUESTIONS}
    body = tiny.decide(request, explain={"top_k": 20, "granularity": granularity})
    for answer in body["answers"].values():
        patches = [item for item in answer["x_evidence"] if "image" in item]
        # One state token against the image's patches: the image fills the rest of the top 20.
        assert len(patches) >= (1 if granularity == "field" else 19)
        for patch in patches:
            assert set(patch) == {"image", "box", "weight"} and patch["image"] == 0
            left, top, right, bottom = patch["box"]
            assert 0 <= left < right <= width and 0 <= top < bottom <= height
            if granularity == "field":
                assert patch["box"] == [0, 0, width, height]


@pytest.mark.parametrize("method", EXPLAIN_METHODS)
def test_the_explain_method_option_reaches_the_engine(tiny: Clef, method: str) -> None:
    engine = variant(tiny, explain_method=method)
    body = engine.decide(ask(TICKET), explain={"top_k": 4})
    assert body["x_explain"]["method"] == method
    assert body["x_explain"]["weights"] == explain.WEIGHT_MEANINGS[method]
    weights = [item["weight"] for answer in body["answers"].values() for item in answer["x_evidence"]]
    assert weights
    if method == "attention":
        assert min(weights) >= 0


def test_a_bad_explain_method_is_refused_naming_the_flag() -> None:
    with pytest.raises(OptionsError, match="--explain-method must be one of"):
        EngineOptions(explain_method="saliency").validate()


def test_the_same_request_gets_the_same_evidence_and_a_cache_hit_changes_nothing(tiny: Clef) -> None:
    assert tiny.decide(ask(TICKET), explain=True) == tiny.decide(ask(TICKET), explain=True)
    cached = variant(tiny, cache_bytes=64 * 2**20)
    missed = cached.decide(ask(TICKET), explain=True)
    assert cached.last_timings.state_hits == 0
    hit = cached.decide(ask(TICKET), explain=True)
    assert cached.last_timings.state_hits == 1
    assert [answer["x_evidence"] for answer in hit["answers"].values()] == [
        answer["x_evidence"] for answer in missed["answers"].values()
    ]


def test_each_tokens_weight_goes_to_its_own_span(tiny: Clef, monkeypatch: pytest.MonkeyPatch) -> None:
    """With weights rising along the state, the strongest tokens are its last ones, strongest first."""

    def rising(*args: Any) -> torch.Tensor:
        rows, targets = args[4], args[5]
        return torch.arange(rows.shape[0], dtype=torch.float32).repeat(len(targets), 1)

    monkeypatch.setattr(explain, "row_attributions", rising)
    body = tiny.decide(ask(TICKET), explain={"top_k": 3, "granularity": "token"})
    _, offsets = tiny.encoder.tokenizer.encode_with_offsets(TICKET)
    last = [TICKET[start:end].strip() for start, end in reversed(offsets[-3:])]
    for answer in body["answers"].values():
        assert [item["text"] for item in answer["x_evidence"]] == last
        assert [item["weight"] for item in answer["x_evidence"]] == [len(offsets) - 1 - n for n in range(3)]
