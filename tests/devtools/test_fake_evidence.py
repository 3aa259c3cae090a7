"""The fake engine's x_explain answers (what the pages' browser tests check the marks against): the real
wire shape, with spans that are exact code point slices of the rendered state and pointers to their member."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

from devtools.fake_engine import FakeClef

QUESTIONS = {"a": {"type": "noul"}, "b": {"type": "noul"}}


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def _resolve(value: Any, pointer: str) -> Any:
    for part in pointer.split("/")[1:]:
        key = _unescape(part)
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def test_a_text_states_evidence_is_its_words_from_the_questions_index_weighted_by_rank() -> None:
    state = "😀 hello wörld, x y z"
    body = FakeClef().decide({"state": state, "questions": QUESTIONS, "x_explain": {"top_k": 3}})
    assert body["x_explain"]["method"] == "fake" and "state_text" not in body["x_explain"]
    first, second = (answer["x_evidence"] for answer in body["answers"].values())
    assert [(i["text"], i["weight"]) for i in first] == [("hello", 1.0), ("wörld", 0.6667), ("x", -0.3333)]
    assert [i["text"] for i in second] == ["wörld", "x", "y"]
    assert all(state[i["start"] : i["end"]] == i["text"] and "path" not in i for i in first + second)


def test_a_json_states_evidence_points_into_its_state_text_and_names_its_member() -> None:
    state = {"t": {"a~/b": "Hi 😀 there", "n": [1.5, True, None]}}
    for granularity in ("word", "field"):
        body = FakeClef().decide(
            {
                "state": state,
                "questions": {"q": {"type": "noul"}},
                "x_explain": {"top_k": 20, "granularity": granularity},
            }
        )
        text = body["x_explain"]["state_text"]
        assert text == json.dumps(state, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        evidence = body["answers"]["q"]["x_evidence"]
        assert evidence and all(text[i["start"] : i["end"]] == i["text"] for i in evidence)
        for item in evidence:  # a key's words, or its member's value
            key = _unescape(item["path"].rsplit("/", 1)[-1])
            assert item["text"] in key or item["text"] in json.dumps(
                _resolve(state, item["path"]), ensure_ascii=False
            )
    fields = [(i["text"], i["path"]) for i in evidence]
    assert fields == [("Hi 😀 there", "/t/a~0~1b"), ("1.5", "/t/n/0"), ("true", "/t/n/1"), ("null", "/t/n/2")]


def test_each_image_gets_a_patch_and_no_explain_means_no_evidence() -> None:
    pixel = "data:image/png;base64," + base64.b64encode(_png()).decode()
    request = {"state": "s t", "images": [pixel, pixel], "questions": QUESTIONS, "x_explain": True}
    items = FakeClef().decide(request)["answers"]["a"]["x_evidence"]
    assert [(i.get("text"), i.get("image"), i["weight"]) for i in items] == [
        ("s", None, 1.0),
        ("t", None, 0.8),
        (None, 0, 0.5),
        (None, 1, 0.5),
    ]
    assert items[2]["box"] == [0, 0, 16, 16]
    plain = FakeClef().decide({"state": "s", "questions": QUESTIONS})
    assert "x_explain" not in plain and all("x_evidence" not in a for a in plain["answers"].values())


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()
