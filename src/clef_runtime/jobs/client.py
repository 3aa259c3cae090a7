"""``clef jobs submit | status | results | cancel | list``: a small client of a server's /v1/jobs routes.

Standard library only (urllib), so the command needs nothing beyond the package. Errors come back as
:class:`ServerClientError` with the server's message; the CLI prints one line and exits 2 (bad input) or 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DEFAULT_URL",
    "JobsClient",
    "ServerClient",
    "ServerClientError",
    "add_api_key_argument",
    "add_jobs_arguments",
    "add_url_argument",
    "format_job",
    "format_job_list",
    "run_jobs",
    "server_url",
]

DEFAULT_URL = "http://127.0.0.1:8094"


class ServerClientError(Exception):
    """A request failed: ``status`` (0 when the server could not be reached), the server's message, and the
    body it answered with (empty without an answer), for a command that words the error its own way."""

    def __init__(self, status: int, message: str, body: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body


class ServerClient:
    """Calls one server's routes with an optional bearer key (the HTTP helper of ``clef jobs`` and ``clef
    heads``)."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout: float = 60) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """(status, body) of a 2xx answer; anything else raises `ServerClientError`."""
        request = urllib.request.Request(self.url + path, data=body, method=method)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            data = exc.read()
            raise ServerClientError(exc.code, _message(data), data) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerClientError(0, f"cannot reach {self.url}: {reason}") from None


class JobsClient(ServerClient):
    """Calls one server's job routes."""

    def submit(
        self, body: bytes, *, idempotency_key: str | None = None, skip_invalid: bool = False
    ) -> dict[str, Any]:
        """POST /v1/jobs; returns the job."""
        headers = {"Content-Type": "application/jsonl"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        query = "?skip_invalid=true" if skip_invalid else ""
        _, data = self.call("POST", "/v1/jobs" + query, body, headers)
        result: dict[str, Any] = json.loads(data)
        return result

    def status(self, job_id: str) -> dict[str, Any]:
        """GET /v1/jobs/{id}."""
        result: dict[str, Any] = json.loads(self.call("GET", f"/v1/jobs/{job_id}")[1])
        return result

    def results(self, job_id: str) -> bytes:
        """GET /v1/jobs/{id}/results: the JSONL of the finished lines."""
        return self.call("GET", f"/v1/jobs/{job_id}/results")[1]

    def cancel(self, job_id: str) -> dict[str, Any]:
        """DELETE /v1/jobs/{id}."""
        result: dict[str, Any] = json.loads(self.call("DELETE", f"/v1/jobs/{job_id}")[1])
        return result

    def list(self, limit: int = 20) -> dict[str, Any]:
        """GET /v1/jobs."""
        result: dict[str, Any] = json.loads(self.call("GET", f"/v1/jobs?limit={limit}")[1])
        return result


def _message(data: bytes) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")[:500]
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, dict):
        return str(detail.get("message", detail))
    if isinstance(detail, list):
        lines = [
            f"{'.'.join(str(part) for part in item.get('loc', []))}: {item.get('msg')}"
            for item in detail[:20]
        ]
        more = body.get("invalid_lines")
        if not more:
            # A refused body (a repeated custom_id, too many lines): one line naming the field.
            return "; ".join(lines) or "invalid request"
        return f"{more} invalid line(s)\n  " + "\n  ".join(lines)
    return json.dumps(body)[:500]


def add_url_argument(parser: argparse.ArgumentParser, *, after_subcommand: bool) -> None:
    """``--url``; a subcommand's copy (``after_subcommand``) has no default, so it never hides a value given
    before the subcommand."""
    parser.add_argument(
        "--url",
        default=argparse.SUPPRESS if after_subcommand else None,
        metavar="URL",
        help=f"the server (default $CLEF_URL, else {DEFAULT_URL}) [env CLEF_URL]",
    )


def add_api_key_argument(parser: argparse.ArgumentParser, *, after_subcommand: bool) -> None:
    """``--api-key``, as `add_url_argument` places it."""
    parser.add_argument(
        "--api-key",
        default=argparse.SUPPRESS if after_subcommand else None,
        metavar="KEY",
        help="API key (default $CLEF_API_KEY; prefer the variable) [env CLEF_API_KEY]",
    )


def server_url(args: argparse.Namespace) -> str:
    """The server a client command calls: ``--url``, else ``$CLEF_URL``, else the default port here."""
    return str(args.url or os.environ.get("CLEF_URL") or DEFAULT_URL)


def _connection_arguments(parser: argparse.ArgumentParser, *, after_subcommand: bool) -> None:
    """``--url`` and ``--api-key``, accepted before the subcommand and after it."""
    add_url_argument(parser, after_subcommand=after_subcommand)
    add_api_key_argument(parser, after_subcommand=after_subcommand)


def add_jobs_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``clef jobs`` subcommands; ``--url`` / ``--api-key`` go before or after the subcommand."""
    _connection_arguments(parser, after_subcommand=False)
    actions = parser.add_subparsers(dest="jobs_command", required=True)
    submit = actions.add_parser("submit", help="submit a JSONL file (one System One request per line)")
    submit.add_argument(
        "file",
        nargs="?",
        default="-",
        metavar="FILE|-",
        help="the JSONL file (one request per line, optional custom_id), or - for stdin (the default)",
    )
    submit.add_argument(
        "--idempotency-key", default=None, metavar="KEY", help="resubmitting with it returns the same job"
    )
    submit.add_argument("--skip-invalid", action="store_true", help="record invalid lines as failed")
    submit.add_argument("--wait", action="store_true", help="wait until the job finishes (progress bar)")
    status = actions.add_parser("status", help="a job's status and counts")
    status.add_argument("job_id", metavar="JOB_ID", help="the job's id (job_...), as submit printed it")
    status.add_argument("--wait", action="store_true", help="wait until the job finishes (progress bar)")
    results = actions.add_parser("results", help="print (or --out) the results as JSONL")
    results.add_argument("job_id", metavar="JOB_ID", help="the job's id (job_...)")
    results.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the results to FILE instead of stdout (JSONL: one {custom_id, line, response|error} "
        "per line, in submission order)",
    )
    cancel = actions.add_parser("cancel", help="cancel a job (finished lines are kept)")
    cancel.add_argument("job_id", metavar="JOB_ID", help="the job's id (job_...)")
    listing = actions.add_parser("list", help="your jobs, newest first")
    listing.add_argument(
        "--limit", type=int, default=20, metavar="N", help="how many jobs (1-100, default 20)"
    )
    for readable in (status, listing):
        readable.add_argument("--json", action="store_true", help="print the server's JSON instead")
    for action in (submit, status, results, cancel, listing):
        _connection_arguments(action, after_subcommand=True)


def _progress(job: dict[str, Any], stream: IO[str]) -> None:
    counts = job["counts"]
    finished = counts["done"] + counts["failed"]
    total = max(counts["total"], 1)
    width = 30
    filled = int(width * finished / total)
    stream.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {finished}/{counts['total']} "
        f"({counts['failed']} failed) {job['status']}   "
    )
    stream.flush()


def _wait(client: JobsClient, job: dict[str, Any]) -> dict[str, Any]:
    terminal = sys.stderr.isatty()
    while job["status"] in ("queued", "running"):
        if terminal:
            _progress(job, sys.stderr)
        time.sleep(0.5)
        job = client.status(job["id"])
    if terminal:
        _progress(job, sys.stderr)
        sys.stderr.write("\n")
    return job


def _lines(job: dict[str, Any]) -> str:
    counts = job.get("counts") or {}
    total, done, failed = counts.get("total", 0), counts.get("done", 0), counts.get("failed", 0)
    share = f" ({(done + failed) / total:.0%} finished)" if total else ""
    return f"{total} total, {done} done, {failed} failed{share}"


def format_job(job: dict[str, Any]) -> str:
    """``clef jobs status``: one ``field  value`` line per field (times in UTC, absent ones left out)."""
    rows = [("id", job.get("id")), ("status", job.get("status")), ("model", job.get("model"))]
    rows += [("lines", _lines(job))]
    rows += [(name, job.get(f"{name}_at")) for name in ("created", "started", "finished")]
    return "\n".join(f"{name:<9} {value}" for name, value in rows if value is not None)


def format_job_list(listing: dict[str, Any]) -> str:
    """``clef jobs list``: a table, newest first, and a note when the server holds more."""
    jobs = listing.get("data") or []
    if not jobs:
        return "no jobs"
    with_model = any("model" in job for job in jobs)  # servers that record the job's model
    header = ["ID", "STATUS", *(["MODEL"] if with_model else []), "TOTAL", "DONE", "FAILED", "CREATED"]
    rows = [header] + [
        [
            str(job.get("id")),
            str(job.get("status")),
            *([str(job.get("model") or "-")] if with_model else []),
            *(str((job.get("counts") or {}).get(key, "")) for key in ("total", "done", "failed")),
            str(job.get("created_at") or ""),
        ]
        for job in jobs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    counts = range(len(header) - 4, len(header) - 1)  # right-aligned, the rest left-aligned
    text = [
        "  ".join(
            row[i].rjust(widths[i]) if i in counts else row[i].ljust(widths[i]) for i in range(len(header))
        ).rstrip()
        for row in rows
    ]
    if listing.get("has_more"):
        text.append(f"(the newest {len(jobs)} shown; more with --limit)")
    return "\n".join(text)


def _follow_hint(args: argparse.Namespace, job_id: str) -> str:
    """The commands that follow a job, with the --url that reached it when one was given."""
    prefix = f"clef jobs --url {args.url}" if args.url else "clef jobs"
    return f"follow it with '{prefix} status {job_id} --wait'; results: '{prefix} results {job_id}'"


def run_jobs(args: argparse.Namespace) -> int:
    """Entry point of ``clef jobs``. Returns 0, 1 (server or network failure) or 2 (bad input)."""
    client = JobsClient(server_url(args), args.api_key or os.environ.get("CLEF_API_KEY"))
    try:
        if args.jobs_command == "submit":
            try:
                body = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
            except OSError as exc:
                print(f"error: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
                return 2
            job = client.submit(body, idempotency_key=args.idempotency_key, skip_invalid=args.skip_invalid)
            # The id first, at once: a long --wait (or an interrupted one) must not hide it.
            print(f"job {job['id']} accepted: {_follow_hint(args, job['id'])}", file=sys.stderr, flush=True)
            if args.wait:
                job = _wait(client, job)
            print(json.dumps(job))
        elif args.jobs_command == "status":
            job = client.status(args.job_id)
            if args.wait:
                job = _wait(client, job)
            print(json.dumps(job) if args.json else format_job(job))
        elif args.jobs_command == "results":
            data = client.results(args.job_id)
            if args.out:
                Path(args.out).write_bytes(data)
            else:
                sys.stdout.write(data.decode("utf-8"))
        elif args.jobs_command == "cancel":
            print(json.dumps(client.cancel(args.job_id)))
        else:
            if not 1 <= args.limit <= 100:
                print("clef jobs list: error: --limit must be between 1 and 100", file=sys.stderr)
                return 2
            listing = client.list(args.limit)
            print(json.dumps(listing) if args.json else format_job_list(listing))
    except ServerClientError as exc:
        print(f"error: {exc.message}" + (f" (HTTP {exc.status})" if exc.status else ""), file=sys.stderr)
        return 2 if exc.status in (400, 404, 409, 413, 415, 422) else 1
    return 0
