"""The batch pipeline, run by the driver: read and check INPUT, skip what OUTPUT holds, group by state,
answer (in this process or on Ray Data), commit each line exactly once, summarise.

Answers are committed in part files of at most ``commit_rows`` rows, or every ``commit_seconds``,
whichever comes first: an interrupted run loses at most that much work, and the rerun computes only the
lines not committed (`BatchSummary.skipped` says how many it found).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from clef_runtime.batch.grouping import Grouping, group_batches
from clef_runtime.batch.inputs import read_input
from clef_runtime.batch.output import BatchOutput, OutputFormat
from clef_runtime.batch.ray_data import RayPool
from clef_runtime.batch.rows import OutputRow, input_rows, output_rows
from clef_runtime.batch.worker import answer_rows, error_row
from clef_runtime.options import EngineOptions

__all__ = ["ANSWER_OPTIONS", "BatchJob", "BatchSummary", "run_batch"]

logger = logging.getLogger("clef_runtime.batch")

ANSWER_OPTIONS = (
    "device",
    "dtype",
    "weights",
    "max_length",
    "image_mode",
    "image_max_tokens",
    "confidence",
    "explain_method",
    "calibration",
    "head",
)
"""The engine options that change answers: OUTPUT records them, and a rerun with others is refused."""


@dataclass(frozen=True)
class BatchJob:
    """One ``clef batch`` run: where from, where to, which model, how."""

    input: str
    output: str
    model: str = "tiny"
    options: EngineOptions = field(default_factory=EngineOptions)
    format: OutputFormat = "parquet"
    batch_rows: int = 64
    grouping: Grouping = "sort"
    commit_rows: int = 10_000
    commit_seconds: float = 30.0
    ray: RayPool | None = None
    """Run on Ray Data with this actor pool; None runs in this process."""
    progress: bool = False
    """Draw a progress bar on stderr."""

    def __post_init__(self) -> None:
        if self.batch_rows < 1 or self.commit_rows < 1:
            raise ValueError("--batch-rows and --commit-rows must be at least 1")


@dataclass(frozen=True)
class BatchSummary:
    """What a run did. ``rows``: INPUT's rows; ``skipped``: already in OUTPUT; ``computed``: written by this
    run (``errors`` of them error rows); ``answered``: computed rows with a response, ``cache_hits`` of
    which found their state whole in the state cache."""

    rows: int
    skipped: int
    computed: int
    errors: int
    answered: int
    cache_hits: int
    seconds: float
    batches: int
    output: str

    @property
    def rows_per_s(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The summary line the command prints."""
        hit_rate = f" ({self.cache_hits / self.answered:.0%})" if self.answered else ""
        return (
            f"clef batch: {self.rows} rows: {self.skipped} already in OUTPUT (skipped), "
            f"{self.computed} computed "
            f"({self.errors} errors) in {self.seconds:.1f} s, {self.rows_per_s:.1f} rows/s; state cache: "
            f"{self.cache_hits} hits of {self.answered} answers{hit_rate}; wrote {self.output}"
        )

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "rows_per_s": round(self.rows_per_s, 3)}


def run_batch(job: BatchJob) -> BatchSummary:
    """Run ``job``. Raises `clef_runtime.batch.inputs.InputError` (a bad INPUT or OUTPUT, a duplicate
    custom_id, an OUTPUT of another job) before any model loads."""
    from clef_runtime.model.resolve import model_identity

    started = time.perf_counter()
    source = read_input(job.input)
    identity = model_identity(job.model)
    recorded = {"input": source.digest, "model": identity.ref}
    recorded.update({name: _plain(getattr(job.options, name)) for name in ANSWER_OPTIONS})
    output = BatchOutput.open(job.output, fmt=job.format, job=recorded)
    table = source.table
    if output.done:
        done = pa.array(sorted(output.done), pa.int64())
        table = table.filter(pc.invert(pc.is_in(table.column("line"), value_set=done)))
    skipped = source.rows - table.num_rows
    if skipped:
        logger.info(
            "%d of %d rows are already in %s: computing the other %d",
            skipped,
            source.rows,
            job.output,
            table.num_rows,
        )
    unusable = table.filter(pc.is_null(table.column("request")))
    usable = table.filter(pc.is_valid(table.column("request")))
    batches = group_batches(usable, job.batch_rows, job.grouping)
    counts = _Counts()
    committer = _Committer(output, job, counts)
    bar = _progress(job.progress, table.num_rows)
    try:
        committer.add([error_row(row, row.error or "{}") for row in input_rows(unusable)], bar)
        for answered in _answers(job, batches):
            committer.add(output_rows(answered), bar)
    finally:
        committer.flush()  # an interrupted run keeps what it computed
        bar.close()
    summary = BatchSummary(
        rows=source.rows,
        skipped=skipped,
        computed=counts.computed,
        errors=counts.errors,
        answered=counts.answered,
        cache_hits=counts.hits,
        seconds=time.perf_counter() - started,
        batches=len(batches),
        output=job.output,
    )
    output.finish(summary.as_json())
    return summary


def _answers(job: BatchJob, batches: Sequence[pa.Table]) -> Iterator[pa.Table]:
    if not batches:
        return iter(())
    options = {name: getattr(job.options, name) for name in EngineOptions.__dataclass_fields__}
    if job.ray is not None:
        from clef_runtime.batch.ray_data import ray_answers

        return ray_answers(batches, job.model, options, job.ray)
    return _local_answers(job, batches, options)


def _local_answers(job: BatchJob, batches: Sequence[pa.Table], options: dict[str, Any]) -> Iterator[pa.Table]:
    from clef_runtime.batch.rows import output_table
    from clef_runtime.batch.worker import load_clef
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()  # before the first parallel torch operation (see model/kernels.py)
    clef = load_clef(job.model, options)
    for batch in batches:
        yield output_table(answer_rows(clef, input_rows(batch)))


@dataclass
class _Counts:
    computed: int = 0
    errors: int = 0
    answered: int = 0
    hits: int = 0


class _Committer:
    """Buffers answered rows and commits them every ``commit_rows`` rows or ``commit_seconds``."""

    def __init__(self, output: BatchOutput, job: BatchJob, counts: _Counts) -> None:
        self.output = output
        self.job = job
        self.counts = counts
        self.pending: list[OutputRow] = []
        self.last = time.monotonic()

    def add(self, rows: Sequence[OutputRow], bar: Any) -> None:
        self.pending.extend(rows)
        bar.update(len(rows))
        if (
            len(self.pending) >= self.job.commit_rows
            or time.monotonic() - self.last >= self.job.commit_seconds
        ):
            self.flush()

    def flush(self) -> None:
        rows, self.pending = self.pending, []
        self.last = time.monotonic()
        if not rows:
            return
        kept = self.output.commit(rows)
        self.counts.computed += len(kept)
        self.counts.errors += sum(row.error is not None for row in kept)
        self.counts.answered += sum(row.response is not None for row in kept)
        self.counts.hits += sum(row.cache == "hit" for row in kept)


class _NoProgress:
    def update(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True, desc="clef batch")


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
