"""Answering a batch of rows with one loaded `Clef`: in this process, or in each Ray Data actor
(`ClefBatchWorker`).

A row is prepared as the server prepares a request (validation, encoding, the token limit); the rows that
pass run together in engine steps (`Clef.decide_settled`: a row the engine fails on fails alone), so rows
about the same state in one batch compute it once. The response is the System One body the jobs route
stores: the decision's body with ``x_truncated_state_tokens``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from clef_runtime.batch.rows import InputRow, OutputRow, input_rows, output_table
from clef_runtime.jobs.runner import error_object
from clef_runtime.protocol.errors import ClefError

if TYPE_CHECKING:
    import pyarrow as pa

    from clef_runtime.engine.clef import Clef

__all__ = ["ClefBatchWorker", "answer_rows", "error_row", "load_clef"]

logger = logging.getLogger("clef_runtime.batch")


def error_row(row: InputRow, error: BaseException | str) -> OutputRow:
    """The output row of a row that failed: ``error`` (an exception, or its ``error_object`` as JSON)."""
    text = error if isinstance(error, str) else json.dumps(error_object(error), ensure_ascii=False)
    return OutputRow(row.custom_id, row.line, None, text)


def answer_rows(clef: Clef, rows: Sequence[InputRow]) -> list[OutputRow]:
    """One output row per input row, in order. Never raises for a row's own fault: an invalid request, a
    request over the token limit or one the engine fails on becomes an error row."""
    from clef_runtime.engine.independent import IndependentRequest

    outputs: dict[int, OutputRow] = {}
    work: list[tuple[InputRow, Any, int]] = []
    for row in rows:
        if row.request is None:
            outputs[row.line] = error_row(row, row.error or '{"type": "invalid_request_error"}')
            continue
        try:
            prepared = clef.prepare(json.loads(row.request))
        except ClefError as exc:
            outputs[row.line] = error_row(row, exc)
            continue
        except Exception as exc:  # a bug on one row must not fail its batch (Ray would fail the whole run)
            logger.warning("line %d could not be prepared: %r", row.line, exc)
            outputs[row.line] = error_row(row, exc)
            continue
        parts = prepared.parts if isinstance(prepared, IndependentRequest) else (prepared,)
        truncated = max(part.record.truncated_state_tokens for part in parts)
        work.append((row, prepared, truncated))
    outcomes = clef.decide_settled([prepared for _, prepared, _ in work]) if work else []
    for (row, _, truncated), outcome in zip(work, outcomes, strict=True):
        if isinstance(outcome, Exception):
            if not isinstance(outcome, ClefError):
                logger.warning("line %d failed in the engine: %r", row.line, outcome)
            outputs[row.line] = error_row(row, outcome)
            continue
        body = outcome.body()
        body["x_truncated_state_tokens"] = truncated
        response = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        outputs[row.line] = OutputRow(row.custom_id, row.line, response, None, outcome.cache.status)
    return [outputs[row.line] for row in rows]


def load_clef(model: str, options: Mapping[str, Any]) -> Clef:
    """The model ``model`` loaded with the engine options ``options`` (`EngineOptions` fields), warmed up."""
    from clef_runtime.engine.clef import Clef
    from clef_runtime.options import EngineOptions

    clef = Clef.load(model, EngineOptions(**options))
    clef.warmup()
    return clef


class ClefBatchWorker:
    """A Ray Data actor that holds one loaded `Clef` and answers batches of input rows (``map_batches``).
    Ray shows its processes as ``ray::MapWorker(MapBatches(ClefBatchWorker))``.

    ``threads``: torch's CPU threads in this actor (its reserved CPUs), so actors sharing a machine do not
    oversubscribe it."""

    def __init__(self, model: str, options: Mapping[str, Any], threads: int | None = None) -> None:
        from clef_runtime.model.kernels import configure_cpu_threads

        configure_cpu_threads(threads)
        self.clef = load_clef(model, options)
        self.pid = os.getpid()
        logger.info("ClefBatchWorker %d: %s loaded", self.pid, model)

    def __call__(self, batch: pa.Table | dict[str, Any]) -> pa.Table:
        return output_table(answer_rows(self.clef, input_rows(batch)))
