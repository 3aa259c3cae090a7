"""``benchmarks/bench_batch.py``: its workload (pairs of rows about one state, far apart in input order) and
its smoke run (``--quick``: ``clef batch`` in this process and the jobs route, on 40 requests), whose report
has every mode's figures and counts that agree with the workload. Never a timing. The Ray modes run in the
full run only (tests/batch/test_ray_batch.py tests `clef batch --ray` itself, its hits included): a Ray head
here would cost the suite a minute of both cores.

The script takes the Ray tests' machine-wide lock itself around each ``--ray`` run (`bench_batch.ray_lock`,
the lock `tests.scale.test_ray_serve.one_ray_cluster_at_a_time` holds): this test must not hold it too, or
the script would wait on it forever. Each command runs in a process session of its own, so the Ray processes
it leaves are told apart from someone else's Ray on this shared machine."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from tests.benchmarks import load_benchmark
from tests.scale.test_ray_serve import ray_processes

bench_batch = load_benchmark("bench_batch")


def _state_positions(requests: list[dict]) -> dict[str, list[int]]:
    positions: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
        positions.setdefault(request["state"], []).append(index)
    return positions


def _in_sessions(processes: list[str], sessions: set[int]) -> list[str]:
    """The processes (``"pid cmdline"``) of ``processes`` that belong to one of ``sessions``."""
    found = []
    for process in processes:
        try:
            if os.getsid(int(process.split()[0])) in sessions:
                found.append(process)
        except ProcessLookupError:
            continue
    return found


def test_the_workload_pairs_30_percent_of_the_rows_far_apart_with_a_new_schema() -> None:
    requests = bench_batch.generate_requests(2000, seed=0)
    assert [request["custom_id"] for request in requests] == [f"req-{i:05d}" for i in range(2000)]
    pairs = [rows for rows in _state_positions(requests).values() if len(rows) > 1]
    assert len(pairs) == 300 and all(len(rows) == 2 for rows in pairs)
    assert all(second - first == 1000 for first, second in pairs)
    assert all(requests[first]["questions"] != requests[second]["questions"] for first, second in pairs)
    assert bench_batch.best_hits(requests) == 300
    words = [len(request["state"].split()) - 2 for request in requests]  # "Ticket N:" is two words
    assert min(words) >= 40 and max(words) <= 120
    assert bench_batch.generate_requests(2000, seed=0) == requests  # deterministic


@pytest.mark.slow
def test_the_quick_run_reports_every_mode_with_consistent_counts(tmp_path: Path) -> None:
    out = tmp_path / "batch.json"
    assert bench_batch.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    sessions = {run["session"] for runs in report["runs"].values() for run in runs if "session" in run}
    assert len(sessions) == 1  # the one clef batch command
    assert not _in_sessions(ray_processes(), sessions), "the benchmark left Ray processes behind"
    assert out.with_suffix(".md").read_text().startswith("| mode |")
    assert report["benchmark"] == "batch" and report["machine"]["cpu"]
    requests = bench_batch.generate_requests(40, seed=0)
    shared = [count for count in Counter(request["state"] for request in requests).values() if count > 1]
    expected_hits = sum(shared) - len(shared)
    assert expected_hits == 6  # 30% of 40 rows: 6 pairs
    assert report["workload"] == {
        "requests": 40,
        "distinct_states": 34,
        "best_hits": expected_hits,
        "best_hit_rate": 0.15,
    }
    assert [entry["mode"] for entry in report["modes"]] == ["inprocess", "jobs"]
    for entry in report["modes"]:
        assert entry["repetitions"] == 1 and entry["every_row_once"], entry
        assert {"rows_per_s", "rows_per_s_wall", "hit_rate", "vs_inprocess"} <= entry.keys()
    for mode, runs in report["runs"].items():
        (run,) = runs
        summary = run["summary"]
        assert summary["computed"] == summary["answered"] == 40 and summary["errors"] == 0, mode
        assert run["hit_rate"] == summary["cache_hits"] / 40
    # One hit per pair: in this process (one state cache) and through the jobs route (one server's cache).
    for mode in ("inprocess", "jobs"):
        assert report["runs"][mode][0]["summary"]["cache_hits"] == expected_hits, mode
    assert report["runs"]["inprocess"][0]["summary"]["skipped"] == 0
    assert report["runs"]["jobs"][0]["server_start_s"] > 0
    grouping = {(entry["rows"], entry["grouping"]): entry for entry in report["grouping"]}
    assert sorted(grouping) == sorted(
        (rows, how) for rows in (40, 400) for how in ("sort", "partition", "none")
    )
    assert grouping[(400, "sort")]["shared_states"] == 60
    # Sorting and partitioning by state put both rows of a pair in one batch; input order (rows 200 apart,
    # batches of 64) never does.
    assert grouping[(400, "sort")]["shared_states_in_one_batch"] == 1.0
    assert grouping[(400, "partition")]["shared_states_in_one_batch"] == 1.0
    assert grouping[(400, "none")]["shared_states_in_one_batch"] == 0.0
