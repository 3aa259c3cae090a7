"""``clef bench``: a quick throughput check of a loaded model that takes every engine option."""

from __future__ import annotations

import json

import pytest

from clef_runtime.bench import synthetic_requests
from clef_runtime.cli import main


def test_a_bad_workload_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "tiny", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err


def test_synthetic_requests_are_distinct_and_sized() -> None:
    requests = synthetic_requests(3, 50)
    assert len({r["state"] for r in requests}) == 3
    assert all(len(r["state"].split()) == 52 for r in requests)  # "ticket N:" + 50 words


@pytest.mark.slow
def test_bench_loads_with_the_engine_options_and_reports_both_ways(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "--model", "tiny", "--requests", "2", "--state-words", "20"]
    assert main([*argv, "--weights", "fp32", "--cache-mb", "0", "--prefill-chunk", "64"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["options"]["weights"] == "fp32"
    assert result["options"]["cache_mb"] == 0
    assert result["options"]["prefill_chunk"] == 64
    for way in ("one_at_a_time", "batched"):
        assert result[way]["tokens"] > 2 * 20 and result[way]["tokens_per_s"] > 0
