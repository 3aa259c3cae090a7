"""What the two OpenAI mapping tests share: the engine's System One reply they build their replies from (a
choice, a boolean and a score: ``team``, ``urgent``, ``priority``, with usage and the state-cache outcome),
and the check that a mapping refuses a request naming the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from clef_runtime.protocol.errors import RequestValidationError

ENGINE_REPLY: dict[str, Any] = {
    "model": "gpt-x",
    "answers": {
        "team": {
            "type": "choice",
            "choice": "tech",
            "confidence": 0.6,
            "probabilities": {"billing": 0.3, "tech": 0.6, "sales": 0.1},
        },
        "urgent": {"type": "noul", "noul": 0.25},
        "priority": {
            "type": "score",
            "score": 1.1,
            "confidence": 0.5,
            "legend": {"0": "1", "1": "2", "2": "3"},
            "probabilities": {"0": 0.2, "1": 0.5, "2": 0.3},
        },
    },
    "usage": {"input_tokens": 42, "output_tokens": 0, "input_tokens_details": {"cached_tokens": 36}},
    "x_state_cache": "partial",
}


def assert_refused(map_request: Callable[[], Any], loc: tuple[Any, ...], words: str) -> None:
    """``map_request()`` raises a `RequestValidationError` whose first error is at ``loc`` and says
    ``words``."""
    with pytest.raises(RequestValidationError) as info:
        map_request()
    assert info.value.errors[0]["loc"] == loc
    assert words in info.value.errors[0]["msg"]
