"""Load and soak test of ``clef serve`` through the real HTTP stack (a server subprocess on loopback).

Three phases, each against a fresh server process:

* ``soak``: ``--requests`` mixed requests (both routes, 1-4 questions of every type, states of 1-300 words,
  a third of them repeats, a quarter zstd-compressed) at ``--concurrency``, with the instant fake engine
  (``--engine fake``, the server's own cost) or the built-in tiny model (``--engine tiny``). Every response
  must be 200 (or a designed 429) and, with the fake engine, carry exactly the answer of its own request.
  The server's resident memory is read from ``/proc`` after a warm-up of ``--warmup`` requests and again
  after the run.
* ``overflow-flood`` (fake engine only): a slow engine (``--overflow-delay-ms`` per call) with a small
  ``--max-queue`` is flooded at the same concurrency; the queue fills and the surplus gets 429 with
  ``Retry-After`` (its latency there is mostly the wait for the server's CPU, shared by 32 clients).
* ``overflow-probe`` (fake engine only): the queue is held full (one request held running by a gate file
  until the last probe, one waiting, ``--max-queue 1``) and ``--overflow-probes`` requests are sent one at a
  time: how long a 429 takes.

Usage::

    python -m benchmarks.load_test --engine fake --requests 5000 --concurrency 32
    python -m benchmarks.load_test --engine tiny --requests 200 --concurrency 16 --warmup 20 --no-overflow
    python -m benchmarks.load_test --quick                      # smoke run (fake engine, seconds)

The fake engine is the tests' (``devtools/fake_engine.py``): its answers are a pure function of the
request, which is how a misrouted answer is caught.

Prints a JSON report (and writes it with ``--out``); exits 1 when a requirement fails (a status other than
200/429, an unanswered or misrouted request, resident memory more than 10% above the warm-up level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zstandard
from devtools.harness import ServerProcess, engine_launcher, start_clef_server
from devtools.results import add_run_arguments, command_line

MEMORY_TOLERANCE = 0.10


def soak_engine(delay_s: float = 0.0, hold_path: str = "") -> Any:
    """The fake engine for the soak (the factory `devtools.engine_server` calls in the server
    process): every call waits while ``hold_path`` exists (a gate the client controls), and the fake's
    record of every call's states (kept for the API tests) is cleared, so a soak does not measure it."""
    from devtools.fake_engine import FakeClef

    class SoakClef(FakeClef):
        def decide_encoded(self, items: Any) -> list[Any]:
            while hold_path and os.path.exists(hold_path):
                time.sleep(0.005)
            try:
                return super().decide_encoded(items)
            finally:
                self.batches.clear()

    return SoakClef(delay_s=delay_s)


# ---------------------------------------------------------------------------------------------- workload

WORDS = [
    *("refund", "charge", "card", "account", "login", "error", "invoice"),
    *("late", "broken", "urgent", "please", "today", "again"),
]
CHOICE = {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "tech": None}}
SCORE = {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]}
NOUL = {"type": "noul", "instructions": "Is a refund requested?"}


@dataclass(frozen=True)
class Job:
    """One request of the workload."""

    route: str
    body: dict[str, Any]
    compress: bool
    systemone: dict[str, Any]
    """The System One body the request maps to (to compute the fake engine's expected answer)."""


def make_jobs(count: int, seed: int = 0) -> list[Job]:
    """A deterministic mixed workload of ``count`` requests. Returns the jobs in sending order."""
    rng = random.Random(seed)
    jobs: list[Job] = []
    for index in range(count):
        if jobs and rng.random() < 1 / 3:  # a repeat: the same state again (state-cache hits)
            jobs.append(jobs[rng.randrange(len(jobs))])
            continue
        state = f"ticket {index}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 300)))
        kinds = rng.sample(["noul", "choice", "score", "noul2"], rng.randint(1, 4))
        compress = rng.random() < 0.25
        if rng.random() < 0.7:
            questions = {
                kind: {"noul": NOUL, "noul2": NOUL, "choice": CHOICE, "score": SCORE}[kind] for kind in kinds
            }
            body = {"model": "jev-latest", "state": state, "questions": questions}
            jobs.append(Job("/v1/systemone", body, compress, body))
        else:
            decision_questions: list[dict[str, Any]] = []
            systemone_questions: dict[str, Any] = {}
            for kind in kinds:
                if kind.startswith("noul"):
                    decision_questions.append({"type": "predicate", "name": kind, "instructions": "Refund?"})
                    systemone_questions[kind] = {"type": "noul", "instructions": "Refund?"}
                elif kind == "choice":
                    choices = [{"value": "billing"}, {"value": "tech"}]
                    decision_questions.append(
                        {"type": "choice", "name": kind, "instructions": "Team?", "choices": choices}
                    )
                else:
                    levels = [{"label": "low"}, {"label": "high"}]
                    decision_questions.append(
                        {"type": "score", "name": kind, "instructions": "Urgency?", "levels": levels}
                    )
            body = {"model": "clef", "input": state, "questions": decision_questions}
            jobs.append(Job("/v1/decisions", body, compress, {}))
    return jobs


def expected_fake_answers(job: Job) -> dict[str, Any] | None:
    """The fake engine's answers for a System One job (None for other routes)."""
    if job.route != "/v1/systemone":
        return None
    from devtools.fake_engine import FakeClef

    return FakeClef().decide(job.systemone)["answers"]


# ---------------------------------------------------------------------------------------------- server


def start_server(
    engine: str,
    *,
    delay_s: float = 0.0,
    max_queue: int = 256,
    max_batch: int = 32,
    ready_s: float = 300,
    hold_path: Path | None = None,
) -> ServerProcess:
    """Start a server process (``engine``: ``fake`` or ``tiny``) and wait for ``/ready``. With the fake
    engine, ``hold_path``: every engine call waits while that file exists.

    Returns its handle. Raises RuntimeError if it exits or is not ready within ``ready_s``.
    """
    log_path = Path(tempfile.mkstemp(prefix="clef-load-", suffix=".log")[1])
    settings: dict[str, Any] = {"max_queue": max_queue, "max_batch_size": max_batch, "log_level": "warning"}
    settings.update(jobs=False, log_path=log_path, timeout=ready_s)
    if engine == "fake":
        hold = str(hold_path or "")
        settings["launcher"] = engine_launcher(
            "benchmarks.load_test:soak_engine", delay_s=delay_s, hold_path=hold
        )
    return start_clef_server(engine, **settings)


# ---------------------------------------------------------------------------------------------- client


@dataclass
class PhaseReport:
    """What one phase measured."""

    name: str
    engine: str
    requests: int
    concurrency: int
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    transport_errors: int = 0
    wrong_answers: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    p50_429_ms: float | None = None
    p99_429_ms: float | None = None
    rss_after_warmup_mb: float | None = None
    rss_after_run_mb: float | None = None
    rss_growth: float | None = None
    server_exit_status: int | None = None
    failures: list[str] = field(default_factory=list)


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


async def send_all(
    url: str, jobs: list[Job], concurrency: int, check_answers: bool
) -> tuple[Counter[str], list[float], list[float], int, int]:
    """Send ``jobs`` with ``concurrency`` workers. Returns (status counts, latencies of 200s in ms,
    latencies of 429s in ms, transport errors, wrong answers)."""
    statuses: Counter[str] = Counter()
    ok_ms: list[float] = []
    refused_ms: list[float] = []
    errors = 0
    wrong = 0
    compressor = zstandard.ZstdCompressor()
    expected = [expected_fake_answers(job) if check_answers else None for job in jobs]
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index, errors, wrong
        while next_index < len(jobs):
            index = next_index
            next_index += 1
            job = jobs[index]
            data = json.dumps(job.body).encode()
            headers = {"Content-Type": "application/json"}
            if job.compress:
                data = compressor.compress(data)
                headers["Content-Encoding"] = "zstd"
            started = time.perf_counter()
            try:
                response = await client.post(job.route, content=data, headers=headers)
            except httpx.TransportError:
                errors += 1
                continue
            elapsed_ms = (time.perf_counter() - started) * 1000
            statuses[str(response.status_code)] += 1
            if response.status_code == 200:
                ok_ms.append(elapsed_ms)
                answers = response.json()["answers"]
                want = expected[index]
                misrouted = want is not None and answers != want
                incomplete = want is None and len(answers) != len(job.body["questions"])
                if misrouted or incomplete:
                    wrong += 1
            elif response.status_code == 429:
                refused_ms.append(elapsed_ms)
                if not response.headers.get("retry-after"):
                    wrong += 1

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return statuses, ok_ms, refused_ms, errors, wrong


def _record(
    report: PhaseReport,
    statuses: Counter[str],
    ok_ms: list[float],
    refused_ms: list[float],
    errors: int,
    wrong: int,
) -> None:
    """Fill ``report`` with what `send_all` measured: statuses, errors, latency percentiles of the 200s
    and of the 429s (the latter left None when nothing was refused)."""
    report.statuses = dict(sorted(statuses.items()))
    report.transport_errors = errors
    report.wrong_answers = wrong
    report.p50_ms = round(percentile(ok_ms, 0.50), 1)
    report.p99_ms = round(percentile(ok_ms, 0.99), 1)
    report.max_ms = round(max(ok_ms, default=0.0), 1)
    if refused_ms:
        report.p50_429_ms = round(percentile(refused_ms, 0.50), 1)
        report.p99_429_ms = round(percentile(refused_ms, 0.99), 1)


def run_soak(engine: str, requests: int, concurrency: int, warmup: int, seed: int = 0) -> PhaseReport:
    """The soak phase (see the module docstring). Returns its report; ``failures`` lists what failed."""
    report = PhaseReport("soak", engine, requests, concurrency)
    server = start_server(engine)
    try:
        check = engine == "fake"
        warm_jobs = make_jobs(warmup, seed=seed + 1)
        asyncio.run(send_all(server.url, warm_jobs, concurrency, check))
        rss_warm = server.rss_bytes()
        started = time.perf_counter()
        statuses, ok_ms, refused_ms, errors, wrong = asyncio.run(
            send_all(server.url, make_jobs(requests, seed=seed), concurrency, check)
        )
        report.seconds = round(time.perf_counter() - started, 2)
        rss_after = server.rss_bytes()
    finally:
        report.server_exit_status = server.stop()
    _record(report, statuses, ok_ms, refused_ms, errors, wrong)
    report.rss_after_warmup_mb = round(rss_warm / 2**20, 1)
    report.rss_after_run_mb = round(rss_after / 2**20, 1)
    report.rss_growth = round(rss_after / rss_warm - 1, 4)
    answered = sum(statuses.values())
    if answered != requests or errors:
        report.failures.append(f"{requests - answered} requests unanswered ({errors} transport errors)")
    unexpected = {status: n for status, n in statuses.items() if status not in ("200", "429")}
    if unexpected:
        report.failures.append(f"unexpected statuses {unexpected}")
    if wrong:
        report.failures.append(f"{wrong} responses carried the wrong answers (or a 429 without Retry-After)")
    if report.rss_growth > MEMORY_TOLERANCE:
        report.failures.append(f"resident memory grew {report.rss_growth:.1%} after warm-up")
    if report.server_exit_status != 0:
        report.failures.append(f"server exited {report.server_exit_status} on SIGTERM")
    return report


def run_overflow(requests: int, concurrency: int, max_queue: int, delay_s: float) -> PhaseReport:
    """The overflow phase: a slow fake engine, a small queue, a flood. Returns its report; it fails when no
    request was refused, a status other than 200/429 came back, or a request went unanswered."""
    report = PhaseReport("overflow-flood", "fake", requests, concurrency)
    server = start_server("fake", delay_s=delay_s, max_queue=max_queue)
    try:
        started = time.perf_counter()
        statuses, ok_ms, refused_ms, errors, wrong = asyncio.run(
            send_all(server.url, make_jobs(requests, seed=7), concurrency, True)
        )
        report.seconds = round(time.perf_counter() - started, 2)
    finally:
        report.server_exit_status = server.stop()
    _record(report, statuses, ok_ms, refused_ms, errors, wrong)
    if sum(statuses.values()) != requests or errors:
        report.failures.append("requests unanswered")
    if set(statuses) - {"200", "429"}:
        report.failures.append(f"unexpected statuses {report.statuses}")
    if not statuses.get("429"):
        report.failures.append("the queue never overflowed")
    if wrong:
        report.failures.append(f"{wrong} wrong answers or 429s without Retry-After")
    return report


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run_overflow_probe(probes: int) -> PhaseReport:
    """How fast a full queue says no: the engine is held (a gate file) while two requests fill
    ``--max-queue 1`` (one running, one waiting), then ``probes`` requests are sent one after another; the
    gate opens only after the last probe, so every probe meets a full queue however slow the machine is.
    Returns the report; the 429s' latencies are the point. It fails when a probe got anything but 429 or a
    held request was not answered."""
    report = PhaseReport("overflow-probe", "fake", probes, 1)
    hold = Path(tempfile.mkstemp(prefix="clef-hold-")[1])
    server = start_server("fake", max_queue=1, max_batch=1, hold_path=hold)
    statuses: Counter[str] = Counter()
    refused_ms: list[float] = []
    held: list[httpx.Response] = []
    try:
        body = {"state": "hold", "questions": {"q": NOUL}}

        async def hold_and_probe() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                holders = []
                deadline = time.monotonic() + 60  # a bound on waiting, not a timing assumption
                # One at a time: with --max-queue 1 the second must arrive after the first left the queue.
                for metric in ("clef_running_requests", "clef_queue_depth"):
                    holders.append(
                        asyncio.ensure_future(
                            client.post("/v1/systemone", json={**body, "state": f"hold {len(holders)}"})
                        )
                    )
                    while _metric(server.url, metric) < 1:
                        if time.monotonic() > deadline:
                            raise RuntimeError("the queue did not fill")
                        await asyncio.sleep(0.01)
                started = time.perf_counter()
                for index in range(probes):
                    sent = time.perf_counter()
                    response = await client.post("/v1/systemone", json={**body, "state": f"probe {index}"})
                    statuses[str(response.status_code)] += 1
                    if response.status_code == 429 and response.headers.get("retry-after"):
                        refused_ms.append((time.perf_counter() - sent) * 1000)
                report.seconds = round(time.perf_counter() - started, 2)
                hold.unlink()  # open the gate: the held requests finish
                held.extend(await asyncio.gather(*holders))

        asyncio.run(hold_and_probe())
    finally:
        hold.unlink(missing_ok=True)
        report.server_exit_status = server.stop()
    report.statuses = dict(sorted(statuses.items()))
    report.p50_429_ms = round(percentile(refused_ms, 0.50), 1)
    report.p99_429_ms = round(percentile(refused_ms, 0.99), 1)
    report.max_ms = round(max(refused_ms, default=0.0), 1)
    if report.statuses != {"429": probes} or len(refused_ms) != probes:
        report.failures.append(f"probes got {report.statuses}")
    if [r.status_code for r in held] != [200, 200]:
        report.failures.append("a held request was not answered")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns 0 when every phase met its requirements, else 1."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engine", choices=["fake", "tiny"], default="fake")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--overflow-requests", type=int, default=1000)
    parser.add_argument("--overflow-max-queue", type=int, default=8)
    parser.add_argument("--overflow-delay-ms", type=float, default=20.0)
    parser.add_argument("--overflow-probes", type=int, default=200)
    parser.add_argument("--no-overflow", action="store_true")
    add_run_arguments(parser, quick="200 requests, small phases", output="--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.overflow_requests, args.overflow_probes = 200, 50, 200, 20
    reports = [run_soak(args.engine, args.requests, args.concurrency, args.warmup)]
    if args.engine == "fake" and not args.no_overflow:
        reports.append(
            run_overflow(
                args.overflow_requests,
                args.concurrency,
                args.overflow_max_queue,
                args.overflow_delay_ms / 1000,
            )
        )
        reports.append(run_overflow_probe(args.overflow_probes))
    result = {"benchmark": "load_test", "command": command_line(__file__, argv)}
    result["phases"] = [asdict(report) for report in reports]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if any(report.failures for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
