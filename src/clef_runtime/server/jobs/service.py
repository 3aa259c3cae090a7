"""The server side of batch jobs: the store, the runner bound to this server's engine and its loop, and the
validation of a submitted JSONL body.

`JobsService.open(settings, runtime)` opens the SQLite store at startup (a damaged or foreign file, or a
``--jobs-db`` another server owns, stops the server with a clear message; a default database another server
owns turns jobs off with a warning; a file it cannot write does not stop anything: the job routes answer 503
and the decision routes go on); the runner starts once the model is ready and
resumes the unfinished jobs of this server's model (`job_model`): a job is only ever answered by the model
it was submitted to.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from clef_runtime.jobs.runner import JobRunner, error_object
from clef_runtime.jobs.store import (
    JobLine,
    JobModel,
    JobRecord,
    JobStore,
    JobStoreLocked,
    JobStoreUnavailable,
)
from clef_runtime.model.resolve import model_identity
from clef_runtime.protocol.custom_ids import (
    CUSTOM_ID_MAX_CHARS,
    custom_id_error,
    duplicate_message,
    first_duplicate,
    is_valid_custom_id,
)
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.protocol.images import parse_with_images
from clef_runtime.server.runtime import ServerRuntime
from clef_runtime.server.settings import ServerSettings

__all__ = ["CUSTOM_ID_MAX_CHARS", "JobsService", "ParsedJob", "job_model", "parse_job_body"]

logger = logging.getLogger("clef_runtime.jobs")

#: Invalid lines listed in a 422 (the count of all of them is given too).
MAX_LISTED_ERRORS = 100


@dataclass(frozen=True)
class ParsedJob:
    """A validated JSONL body: its lines (invalid ones carry their error) and the invalid lines' errors in
    the 422 shape."""

    lines: list[JobLine]
    errors: list[dict[str, Any]]
    digest: str


def _validate_line(data: Any) -> tuple[str | None, str]:
    """Validate one decoded line; returns (custom_id, the request JSON text without custom_id). Raises
    RequestValidationError naming the field."""
    if not isinstance(data, dict):
        raise RequestValidationError.single((), "a line must be a JSON object (a System One request)", "type")
    body = dict(data)
    custom_id = body.pop("custom_id", None)
    if custom_id is not None and not is_valid_custom_id(custom_id):
        raise custom_id_error()
    parse_with_images(body)
    return custom_id, json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def parse_job_body(raw: bytes, *, max_lines: int) -> ParsedJob:
    """Split and validate a JSONL job body (blank lines are ignored; lines are numbered as in the file, from
    1). Returns every line, valid or not, and the errors of the invalid ones. Raises RequestValidationError
    for a body that is not UTF-8, holds no line, more than ``max_lines`` lines, or repeats a custom_id (at
    the second line that uses it)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError.single(
            ("body",), f"the body is not UTF-8 (byte {exc.start})", "json_invalid"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines: list[JobLine] = []
    errors: list[dict[str, Any]] = []
    for number, line_text in enumerate(text.splitlines(), start=1):
        if not line_text.strip():
            continue
        if len(lines) >= max_lines:
            raise RequestValidationError.single(
                ("body",), f"the job has more than {max_lines} lines (--jobs-max-lines)", "too_long"
            )
        try:
            data = json.loads(line_text, parse_constant=_reject_constant)
            custom_id, request = _validate_line(data)
        except json.JSONDecodeError as exc:
            error = RequestValidationError.single(
                (), f"malformed JSON: {exc.msg} at column {exc.colno}", "json_invalid"
            )
            lines.append(JobLine(number, None, None, json.dumps(error_object(error))))
            errors.extend(_line_errors(number, error))
            continue
        except (RequestValidationError, ValueError) as exc:
            error = (
                exc
                if isinstance(exc, RequestValidationError)
                else RequestValidationError.single((), str(exc), "value_error")
            )
            custom_id = data.get("custom_id") if isinstance(data, dict) else None
            lines.append(
                JobLine(
                    number,
                    custom_id if isinstance(custom_id, str) else None,
                    None,
                    json.dumps(error_object(error)),
                )
            )
            errors.extend(_line_errors(number, error))
            continue
        lines.append(JobLine(number, custom_id, request))
    if not lines:
        raise RequestValidationError.single(
            ("body",), "the job holds no line (one JSON request per line)", "missing"
        )
    _refuse_duplicate_custom_ids(lines)
    digest = hashlib.sha256(raw).hexdigest()
    return ParsedJob(lines, errors, digest)


def _refuse_duplicate_custom_ids(lines: list[JobLine]) -> None:
    """Results are joined back by custom_id: a repeated one refuses the whole job, ``?skip_invalid`` or not
    (the repeat is no fault of one line to record as failed, and a job must not be half-run). Only a valid
    custom_id counts, on a valid line or an invalid one (its failed result carries the id too)."""
    repeated = first_duplicate(
        (line.line, line.custom_id if is_valid_custom_id(line.custom_id) else None) for line in lines
    )
    if repeated is not None:
        custom_id, first_line, line = repeated
        raise RequestValidationError.single(
            ("body", "line", line, "custom_id"), duplicate_message(custom_id, first_line), "value_error"
        )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _line_errors(number: int, error: RequestValidationError) -> list[dict[str, Any]]:
    return [
        {"loc": ["body", "line", number, *item["loc"]], "msg": item["msg"], "type": item["type"]}
        for item in error.errors
    ]


def job_model(spec: str) -> JobModel:
    """The model jobs record for the ``--model`` value ``spec``, known before the model loads (jobs are
    accepted while it loads): `model_identity`, the loader's own reading of the spec."""
    identity = model_identity(spec)
    return JobModel(identity.name, identity.ref)


class JobsService:
    """The store and the runner of one server process, bound to the model it serves."""

    def __init__(
        self, settings: ServerSettings, runtime: ServerRuntime, store: JobStore, model: JobModel
    ) -> None:
        self.settings = settings
        self.runtime = runtime
        self.store = store
        self.model = model
        self.runner = JobRunner(store, model, self._prepare, self._submit, on_line=self._count)
        self._started = False
        self._lock = threading.Lock()

    @classmethod
    def open(cls, settings: ServerSettings, runtime: ServerRuntime) -> JobsService | None:
        """Open the store at ``settings.jobs_db_path`` and own it while the server runs. Returns None (jobs
        off, one warning says why) when another server owns the default database. Raises JobStoreError for a
        damaged or foreign file, JobStoreLocked when another server owns the ``--jobs-db`` file. A file that
        cannot be written (read-only, busy) opens all the same: the job routes answer 503 when they write."""
        model = job_model(settings.model)
        try:
            store = JobStore(settings.jobs_db_path)
        except JobStoreLocked as exc:
            if settings.jobs_db:
                raise  # the user named this file: serving without it would not be what they asked for
            # A default nobody chose (two servers on --port 0, say): decisions need no jobs database.
            logger.warning(
                "batch jobs are off: the default jobs database %s is in use by another clef-runtime server "
                "(%s); give this server its own with --jobs-db PATH",
                exc.path,
                f"pid {exc.pid}" if exc.pid is not None else "pid unknown",
            )
            return None
        try:
            try:
                claimed = store.claim_unbound(model)
            except JobStoreUnavailable as exc:
                # Startup must not depend on a write: the jobs stay unclaimed for the next server that can.
                logger.warning("the jobs that recorded no model stay unclaimed by %s: %s", model.label, exc)
            else:
                if claimed:
                    logger.info("%d job(s) that recorded no model now belong to %s", claimed, model.label)
            logger.info("batch jobs of model %s stored in %s", model.label, store.path)
            return cls(settings, runtime, store, model)
        except BaseException:
            store.close()  # drops the lock too, so a retry (or another server) can open the file
            raise

    def describe(self, record: JobRecord) -> dict[str, Any]:
        """The API body of a job; an unfinished job of another model says why it does not move."""
        body = record.as_api()
        if record.unfinished and (record.model is None or record.model.ref != self.model.ref):
            other = record.model.label if record.model is not None else "an unknown model"
            body["x_waiting_for_model"] = (
                f"this job was submitted to model {other}; this server runs {self.model.label} and leaves it "
                "queued until a server of that model opens this jobs database"
            )
        return body

    def _prepare(self, request: Any) -> tuple[Any, int, dict[str, Any]]:
        engine = self.runtime.require_ready()
        prepared = self.runtime.prepare_sync(engine, request)
        record = prepared.record
        return prepared, record.input_tokens, {"x_truncated_state_tokens": record.truncated_state_tokens}

    def _submit(self, prepared: Any, tokens: int) -> Any:
        return self.runtime.submit_background(prepared)

    def _count(self, ok: bool) -> None:
        self.runtime.metrics.job_lines.labels("done" if ok else "failed").inc()

    def start_when_ready(self) -> None:
        """Start the runner once the model is loaded (on a helper thread, so startup is not blocked)."""

        def wait_then_start() -> None:
            if self.runtime.wait_until_loaded():
                with self._lock:
                    if not self._started:
                        self._started = True
                        self.runner.start()

        threading.Thread(target=wait_then_start, name="clef-jobs-start", daemon=True).start()

    def stop(self) -> None:
        """Stop the runner (lines in flight stay unanswered and resume after a restart); close the store."""
        self.runner.stop()
        self.store.close()
