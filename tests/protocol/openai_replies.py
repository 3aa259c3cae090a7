"""The engine's System One reply both OpenAI mapping tests build their replies from: a choice, a boolean
and a score (``team``, ``urgent``, ``priority``), with usage and the state-cache outcome."""

from __future__ import annotations

from typing import Any

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
