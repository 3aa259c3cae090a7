"""``/v1/jobs``: durable batch jobs (submit a JSONL body, poll, stream results, cancel, list).

Jobs belong to the API key that created them (a digest of it; all callers share one owner with auth off):
another key gets 404 for them, as if they did not exist. A job records the model it was submitted to; an
unfinished job of another model (the jobs database was served by another model before) stays queued and
says so in ``x_waiting_for_model``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, ExitStack, asynccontextmanager
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from clef_runtime.jobs.store import (
    IdempotencyConflict,
    JobRecord,
    JobStoreUnavailable,
    TooManyActiveJobs,
    owner_of,
)
from clef_runtime.protocol.errors import RequestValidationError
from clef_runtime.server.admission import admit_caller, authenticate
from clef_runtime.server.bodies import decode_content, read_body
from clef_runtime.server.errors import ERROR_RESPONSES, ApiError, validation_error
from clef_runtime.server.feature import Feature
from clef_runtime.server.jobs.service import MAX_LISTED_ERRORS, JobsService, parse_job_body
from clef_runtime.server.openapi import json_example
from clef_runtime.server.runtime import runtime_of

__all__ = ["FEATURE", "router"]

router = APIRouter()

_IDEMPOTENCY_KEY_MAX = 256

_JOB_EXAMPLE = {
    "id": "job_5a0c3c0e2f7b4f0f9e1d2c3b4a596877",
    "object": "job",
    "model": "clef-flash",
    "status": "running",
    "counts": {"total": 2000, "done": 812, "failed": 3},
    "progress": 0.4075,
    "created_at": "2026-12-01T09:00:00.000Z",
    "started_at": "2026-12-01T09:00:00.120Z",
    "finished_at": None,
}
_LINE = '{"custom_id": "%s", "state": "%s", "questions": {"refund": {"type": "noul"}}}'
_SUBMIT_EXAMPLES = {
    "tickets": {
        "summary": "Two support tickets, one question each",
        "value": "\n".join(
            [_LINE % ("t-1", "Charged twice, please refund."), _LINE % ("t-2", "The app crashes on login.")]
        )
        + "\n",
    },
    "mixed_types": {
        "summary": "A choice and a score question about one listing",
        "value": '{"custom_id": "listing-9", "state": {"title": "Red bike", "price": 120}, "questions": '
        '{"category": {"type": "choice", "criteria": {"sports": null, "toys": null}}, '
        '"quality": {"type": "score", "criteria": ["poor", "fair", "good"]}}}\n',
    },
}
_RESULTS_EXAMPLE = (
    '{"custom_id":"t-1","line":1,"response":{"model":"tiny","answers":{"refund":{"type":"noul",'
    '"noul":0.91}},"usage":{"input_tokens":121,"output_tokens":0},"x_truncated_state_tokens":0}}\n'
    '{"custom_id":"t-2","line":2,"error":{"type":"invalid_request_error","message":"..."}}\n'
)


# What every job route may answer besides its 200: auth, a job of another key (or jobs off), a bad query,
# and the store being unavailable.
_JOB_ERRORS: dict[int | str, dict[str, Any]] = {
    401: ERROR_RESPONSES[401],
    404: {**ERROR_RESPONSES[401], "description": "No such job for this API key, or batch jobs are off"},
    422: ERROR_RESPONSES[422],
    503: {**ERROR_RESPONSES[503], "description": "The job store is unavailable; see Retry-After"},
}


def _service(request: Request) -> JobsService:
    service: JobsService | None = getattr(request.app.state, "jobs", None)
    if service is None:
        raise ApiError(404, "not_found_error", "batch jobs are disabled on this server (--jobs off)")
    return service


def _owner(request: Request) -> str:
    authenticate(request)
    keys = runtime_of(request).keys
    return owner_of(keys.presented_key(request.headers) if keys.enabled else None)


async def _store_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except JobStoreUnavailable as exc:
        raise ApiError(
            503, "jobs_unavailable", f"batch jobs are unavailable: {exc}", headers={"Retry-After": "30"}
        ) from None


@router.post(
    "/v1/jobs",
    status_code=202,
    summary="Submit a batch job: one System One request per line (JSONL), answered in the background",
    description="Stores every line of a JSONL body (one System One request per line, with an optional "
    "`custom_id`) and answers them in the background, only when no interactive request is waiting. Every "
    "line is validated first: invalid lines give a 422 listing them (`loc: [body, line, N, ...]`), or are "
    "recorded as failed with `?skip_invalid=true`. A `custom_id` repeated by a later line refuses the whole "
    "job (422 at `body.line.N.custom_id` of the repeat). The job survives a server crash or restart.",
    responses={
        202: json_example("The stored job", {**_JOB_EXAMPLE, "status": "queued"}),
        200: json_example(
            "The same Idempotency-Key and body again: the job stored the first time (nothing new is stored)",
            _JOB_EXAMPLE,
        ),
        409: {"description": "Idempotency-Key reused with another body"},
        **ERROR_RESPONSES,
        404: _JOB_ERRORS[404],
    },
    openapi_extra={
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "maxLength": _IDEMPOTENCY_KEY_MAX},
                "description": "The same key and body return the same job; another body -> 409",
            }
        ],
        "requestBody": {
            "required": True,
            "content": {"application/jsonl": {"schema": {"type": "string"}, "examples": _SUBMIT_EXAMPLES}},
        },
    },
)
async def submit_job(request: Request, skip_invalid: bool = Query(False)) -> JSONResponse:
    """Validate every line (422 listing the invalid ones, unless ``skip_invalid=true`` records them as
    failed) and store the job; 202 with its id. Lines are answered when no interactive request waits."""
    service = _service(request)
    admit_caller(request)  # a submission counts once against the caller's --rate-limit, whatever its lines
    owner = _owner(request)
    settings = service.settings
    idempotency_key = request.headers.get("idempotency-key")
    if idempotency_key is not None and not 1 <= len(idempotency_key) <= _IDEMPOTENCY_KEY_MAX:
        raise ApiError(
            400, "invalid_request_error", f"Idempotency-Key must be 1-{_IDEMPOTENCY_KEY_MAX} chars"
        )
    raw = await read_body(request, settings.jobs_max_bytes)
    encoding = request.headers.get("content-encoding")

    def parse() -> Any:
        return parse_job_body(
            decode_content(raw, encoding, settings.jobs_max_bytes), max_lines=settings.jobs_max_lines
        )

    try:
        parsed = await anyio.to_thread.run_sync(parse)
    except RequestValidationError as exc:
        raise validation_error(exc.errors) from None
    if parsed.errors and not skip_invalid:
        invalid = sorted({e["loc"][2] for e in parsed.errors})
        return JSONResponse(
            {
                "detail": parsed.errors[:MAX_LISTED_ERRORS],
                "invalid_lines": len(invalid),
                "message": f"{len(invalid)} invalid line(s) (first: line {invalid[0]}); fix them or submit "
                "with ?skip_invalid=true to record them as failed",
            },
            status_code=422,
        )
    try:
        # The store checks the limit in the transaction that inserts, and only for a new job: a replayed
        # Idempotency-Key gets its job back even at the limit.
        record, created = await _store_call(
            service.store.create,
            owner,
            parsed.lines,
            model=service.model,
            body_digest=parsed.digest,
            idempotency_key=idempotency_key,
            max_active=settings.jobs_max_active,
        )
    except IdempotencyConflict as exc:
        raise ApiError(409, "idempotency_conflict", str(exc)) from None
    except TooManyActiveJobs as exc:
        raise ApiError(
            429, "too_many_jobs", f"{exc} (--jobs-max-active)", headers={"Retry-After": "60"}
        ) from None
    if created:
        service.runner.notify()
    return JSONResponse(service.describe(record), status_code=202 if created else 200)


@router.get(
    "/v1/jobs",
    summary="The caller's batch jobs, newest first",
    description="Lists the jobs created with the caller's API key (all jobs when the server has no keys), "
    "newest first, `limit` at a time; pass `after=<last_id>` for the next page.",
    responses={
        200: json_example(
            "A page of jobs",
            {"object": "list", "data": [_JOB_EXAMPLE], "has_more": False, "last_id": _JOB_EXAMPLE["id"]},
        ),
        **_JOB_ERRORS,
    },
)
async def list_jobs(
    request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = Query(None)
) -> dict[str, Any]:
    """``{"object": "list", "data": [job...], "has_more", "last_id"}``; pass ``after=last_id`` for the next
    page."""
    service = _service(request)
    owner = _owner(request)
    records, more = await _store_call(service.store.list, owner, limit=limit, after=after)
    data = [service.describe(r) for r in records]
    return {"object": "list", "data": data, "has_more": more, "last_id": data[-1]["id"] if data else None}


async def _job_or_404(
    request: Request, job_id: str, *, cancel: bool = False
) -> tuple[JobsService, JobRecord]:
    """The caller's job (cancelled first with ``cancel``), or a 404 when the key has no such job."""
    service = _service(request)
    owner = _owner(request)
    action = service.store.cancel if cancel else service.store.get
    record = await _store_call(action, job_id, owner)
    if record is None:
        raise ApiError(404, "not_found_error", f"no job {job_id!r} for this key")
    return service, record


@router.get(
    "/v1/jobs/{job_id}",
    summary="A batch job's status, counts and progress",
    description="Status (`queued`, `running`, `completed` or `cancelled`), the model the job was submitted "
    "to, the counts of lines done and failed, progress and timestamps. Another API key's job is a 404. A job "
    "is only answered by its own model: an unfinished job of another model stays queued, and "
    "`x_waiting_for_model` says which model it waits for.",
    responses={
        200: json_example("The job", _JOB_EXAMPLE),
        **_JOB_ERRORS,
    },
)
async def get_job(request: Request, job_id: str) -> dict[str, Any]:
    """Status ``queued | running | completed | cancelled``, counts, progress and timestamps."""
    service, record = await _job_or_404(request, job_id)
    return service.describe(record)


@router.get(
    "/v1/jobs/{job_id}/results",
    summary="A batch job's results so far, as JSONL in submission order (streamed)",
    description="One line per finished request, in line order: `{custom_id, line, response}` with the System "
    "One response, or `{custom_id, line, error}`. Available while the job runs (only finished lines).",
    response_class=StreamingResponse,
    responses={
        200: {"description": "JSONL", "content": {"application/jsonl": {"example": _RESULTS_EXAMPLE}}},
        **_JOB_ERRORS,
    },
)
async def job_results(request: Request, job_id: str) -> Response:
    """One line per finished request: ``{"custom_id", "line", "response"}`` or ``{"custom_id", "line",
    "error"}``, in line order; lines not answered yet are left out (fetch again later)."""
    service, _ = await _job_or_404(request, job_id)

    async def lines() -> AsyncIterator[bytes]:
        after = 0
        while True:
            page = await _store_call(service.store.results, job_id, after_line=after, limit=500)
            if not page:
                return
            chunk = []
            for result in page:
                key = "response" if result.ok else "error"
                chunk.append(
                    json.dumps(
                        {"custom_id": result.custom_id, "line": result.line, key: result.payload},
                        ensure_ascii=False,
                        separators=(",", ":"),
                    )
                )
            yield ("\n".join(chunk) + "\n").encode("utf-8")
            after = page[-1].line

    return StreamingResponse(lines(), media_type="application/jsonl")


@router.delete(
    "/v1/jobs/{job_id}",
    summary="Cancel a batch job (its finished lines are kept)",
    description="Stops a queued or running job: lines not answered yet are dropped, finished ones stay "
    "readable. A finished job is returned unchanged.",
    responses={200: json_example("The job", {**_JOB_EXAMPLE, "status": "cancelled"}), **_JOB_ERRORS},
)
async def cancel_job(request: Request, job_id: str) -> dict[str, Any]:
    """Cancel a queued or running job; a finished job is returned unchanged."""
    service, record = await _job_or_404(request, job_id, cancel=True)
    return service.describe(record)


def _open_jobs(app: FastAPI, resources: ExitStack) -> AbstractAsyncContextManager[None] | None:
    """Open the jobs database now (a damaged or foreign one stops the server before it listens) and run the
    jobs while the server serves."""
    settings = app.state.settings
    jobs = JobsService.open(settings, app.state.runtime) if settings.jobs else None
    app.state.jobs = jobs
    if jobs is None:
        return None
    resources.callback(jobs.store.close)
    return _running(jobs)


@asynccontextmanager
async def _running(jobs: JobsService) -> AsyncIterator[None]:
    jobs.start_when_ready()
    try:
        yield
    finally:
        # After uvicorn has finished every accepted request: job lines in flight finish or stay unanswered
        # (resumed after a restart), before the engine loop drains the interactive requests.
        await anyio.to_thread.run_sync(jobs.runner.stop)


FEATURE = Feature("jobs", router, attach=_open_jobs)
"""``/v1/jobs``: batch jobs in the engine's background lane."""
