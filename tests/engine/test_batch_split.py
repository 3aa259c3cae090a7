"""A batch of long cold rows is split into calls of bounded rows x tokens; the answers stay those of
the requests run one by one."""

from __future__ import annotations

from typing import Any

import pytest

from clef_runtime import Clef
from clef_runtime.model.backbone import DEFAULT_MAX_CALL_TOKENS


@pytest.fixture(scope="module")
def clef() -> Clef:
    return Clef.load("tiny", dtype="fp32", cache_mb=0)


def _body(index: int, words: int) -> dict[str, Any]:
    state = " ".join(f"item{index}-{n % 37} charged twice" for n in range(words))
    return {
        "state": state,
        "questions": {
            "refund": {"type": "noul", "instructions": f"Refund wanted? ({index})"},
            "team": {"type": "choice", "criteria": {"billing": "charges", "tech": None, "sales": None}},
        },
    }


@pytest.mark.slow
def test_split_batch_answers_equal_one_by_one(clef: Clef) -> None:
    items = [clef.prepare(_body(index, words)) for index, words in enumerate((60, 45, 80, 52, 70, 66))]
    longest = max(item.record.input_tokens for item in items)
    assert longest > 300

    clef.backbone.max_call_tokens = None
    try:
        alone = [clef.probabilities_encoded([item])[0] for item in items]
    finally:
        clef.backbone.max_call_tokens = 6 * 64  # six rows: 64-token calls
    try:
        before = clef.backbone.calls
        batched = clef.probabilities_encoded(items)
        calls = clef.backbone.calls - before
    finally:
        clef.backbone.max_call_tokens = DEFAULT_MAX_CALL_TOKENS
    # Without the cap the cold batch would run in at most 1 + 4 snapshot cuts (5 calls); with it, one call
    # per 64 tokens of the longest row at least.
    assert calls >= -(-(longest - clef.prefix_state.length) // 64)
    for one, many in zip(alone, batched, strict=True):
        for p, q in zip(one, many, strict=True):
            assert max(abs(a - b) for a, b in zip(p, q, strict=True)) <= 1e-5
