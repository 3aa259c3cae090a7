"""The eval report's wording: an untrained model's report leads with a banner (text and HTML), a trained
one's has none, and latencies read as a person reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clef_runtime.evaluation.metrics import Outcome, summarize
from clef_runtime.evaluation.report import format_ms, text_summary, write_report


def summary(latencies_ms: list[float]) -> dict[str, Any]:
    outcomes = [
        Outcome(f"c{i}", "q", "noul", ("true", "false"), np.array([p, 1 - p]), i % 2)
        for i, p in enumerate((0.9, 0.2, 0.6, 0.4))
    ]
    return summarize(outcomes, latencies_ms)


def source(untrained: bool) -> dict[str, Any]:
    return {"kind": "in-process", "model": "tiny" if untrained else "m", "untrained": untrained}


@pytest.mark.parametrize(
    ("value", "text"),
    [(399.9933, "400"), (1234.56, "1235"), (99.94, "99.9"), (12.345, "12.3"), (0.04, "0.0"), (None, "-")],
)
def test_latencies_are_rounded_to_what_was_measured(value: float | None, text: str) -> None:
    assert format_ms(value) == text


def test_text_summary_of_an_untrained_model_leads_with_a_banner() -> None:
    lines = text_summary(summary([399.9933, 401.2]), source(untrained=True)).splitlines()
    assert lines[0].startswith("WARNING: UNTRAINED MODEL: tiny has random weights")
    assert "not how accurate" in lines[0]
    assert lines[-1] == "latency: p50 401 ms, p95 401 ms"
    trained = text_summary(summary([12.345]), source(untrained=False))
    assert "UNTRAINED" not in trained and "WARNING" not in trained
    assert trained.splitlines()[-1] == "latency: p50 12.3 ms, p95 12.3 ms"


def test_html_report_of_an_untrained_model_shows_the_banner_first(tmp_path: Path) -> None:
    page = write_report(summary([399.9933]), source(untrained=True), tmp_path / "u").read_text()
    body = page.split("<body>", 1)[1]
    assert body.startswith('<h1>clef eval report</h1><p class="untrained" role="alert"><strong>UNTRAINED')
    assert "Latency p50 400 ms, p95 400 ms." in page and "399.99" not in page
    trained = write_report(summary([5.0]), source(untrained=False), tmp_path / "t").read_text()
    assert 'class="untrained"' not in trained and "UNTRAINED" not in trained
