"""Resuming: a ``clef batch`` process killed (or interrupted) mid-run leaves only whole part files; the rerun
with the same OUTPUT computes exactly the rows not written, and every line ends up in OUTPUT once."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from clef_runtime.batch.output import read_output
from tests.batch.processes import start_batch
from tests.batch.requests import outputs_by_line, ticket_requests, write_jsonl
from tests.helpers import run_cli

pytestmark = pytest.mark.slow

ROWS = 400


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["killed", "interrupted"])
def test_the_rerun_computes_only_the_rows_not_yet_written(tmp_path: Path, stop: signal.Signals) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", ticket_requests(ROWS, 100, filler_words=40))
    out = tmp_path / "out"
    args = (str(source), str(out), "--batch-rows", "8", "--commit-rows", "16")
    process = start_batch(*args, log=tmp_path / "first.log")
    deadline = time.monotonic() + 240
    while len(list(out.glob("part-*.parquet"))) < 2:
        assert process.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, "no part file committed"
        time.sleep(0.05)
    process.send_signal(stop)
    status = process.wait(60)
    log = (tmp_path / "first.log").read_text()
    committed = outputs_by_line(read_output(str(out)))
    # Stopped mid-run: some rows are written, not all.
    assert 32 <= len(committed) < ROWS, log
    if stop == signal.SIGINT:
        # A graceful interrupt commits what was answered before exiting 130.
        assert status == 130, log
    else:
        assert status == -signal.SIGKILL
    rerun = run_cli("batch", *args)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert (summary["skipped"], summary["computed"]) == (len(committed), ROWS - len(committed))
    assert f"{len(committed)} already in OUTPUT (skipped)" in rerun.stderr
    final = outputs_by_line(read_output(str(out)))
    assert sorted(final) == list(range(1, ROWS + 1))
    assert all(row.response is not None for row in final.values())
    # The rows written before the stop are kept as they were, not recomputed.
    assert all(final[line] == row for line, row in committed.items())
    assert not list(out.glob(".tmp-*"))
