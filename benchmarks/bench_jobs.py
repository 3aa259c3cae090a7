"""Interactive latency while a large batch job runs, and the job's throughput, through a real server.

For each ``--jobs-batch-size`` given, one ``clef serve`` process (the built-in tiny model unless ``--model``)
is started, then ``--reps`` times (default 3), all in the same run:

1. idle: ``--probes`` interactive requests, one at a time with ``--gap-ms`` between them;
2. job only: a job of ``--lines`` lines is submitted and its throughput measured for ``--job-seconds``;
3. busy: the same interactive probes while that job keeps running, with the job's throughput meanwhile;

then the job is cancelled. Every request has its own state (no state-cache hits), ~``--state-words`` words,
three questions. The requirement is busy p50 <= 1.5x idle p50, reported per repetition and as the median
with its range. Writes raw JSON and a markdown table.

Usage::

    python -m benchmarks.bench_jobs --out benchmarks/results/jobs-2.json
    python -m benchmarks.bench_jobs --quick --out /tmp/jobs.json          # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from devtools.harness import start_clef_server
from devtools.models import resolve_model
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import percentile, spread

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "criteria": {"billing": "charges", "tech": "bugs", "sales": None}},
    "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
}
_TEXT = "the customer writes that the invoice shows a double charge and the app crashes on login"
WORDS = _TEXT.split()


def state(tag: str, words: int) -> str:
    body = " ".join(WORDS[i % len(WORDS)] for i in range(words))
    return f"[{tag}] {body}"


def probe(client: httpx.Client, count: int, gap_s: float, words: int, tag: str) -> list[float]:
    latencies = []
    for i in range(count):
        body = {"state": state(f"{tag}-{i}", words), "questions": QUESTIONS}
        started = time.perf_counter()
        response = client.post("/v1/systemone", json=body)
        latencies.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
        time.sleep(gap_s)
    return latencies


def done_lines(client: httpx.Client, job_id: str) -> int:
    counts = client.get(f"/v1/jobs/{job_id}").json()["counts"]
    return int(counts["done"] + counts["failed"])


def summary(latencies: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(latencies), 1),
        "p95_ms": round(percentile(latencies, 0.95), 1),
        "mean_ms": round(statistics.fmean(latencies), 1),
    }


def one_rep(client: httpx.Client, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    """Idle probes, the job alone, probes beside the job; the job is cancelled at the end."""
    gap_s = args.gap_ms / 1000
    idle = probe(client, args.probes, gap_s, args.state_words, f"idle{rep}")
    lines = "\n".join(
        json.dumps(
            {"custom_id": str(i), "state": state(f"job{rep}-{i}", args.state_words), "questions": QUESTIONS}
        )
        for i in range(args.lines)
    )
    job = client.post("/v1/jobs", content=lines.encode()).json()
    while done_lines(client, job["id"]) == 0:
        time.sleep(0.05)
    start_done, started = done_lines(client, job["id"]), time.perf_counter()
    time.sleep(args.job_seconds)
    alone = (done_lines(client, job["id"]) - start_done) / (time.perf_counter() - started)
    start_done, started = done_lines(client, job["id"]), time.perf_counter()
    busy = probe(client, args.probes, gap_s, args.state_words, f"busy{rep}")
    during = (done_lines(client, job["id"]) - start_done) / (time.perf_counter() - started)
    client.delete(f"/v1/jobs/{job['id']}")
    return {
        "idle": summary(idle),
        "busy": summary(busy),
        "busy_over_idle_p50": round(statistics.median(busy) / statistics.median(idle), 3),
        "job_lines_per_s_alone": round(alone, 2),
        "job_lines_per_s_during_probes": round(during, 2),
        "raw_ms": {"idle": [round(x, 1) for x in idle], "busy": [round(x, 1) for x in busy]},
    }


def run_one(args: argparse.Namespace, model: str, batch_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = start_clef_server(
            model,
            log_path=Path(tmp) / "server.log",
            jobs_db=str(Path(tmp) / "jobs.sqlite3"),
            jobs_batch_size=batch_size,
            log_level="warning",
        )
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:
                probe(client, 3, 0.0, args.state_words, "warm")
                reps = [one_rep(client, args, rep) for rep in range(args.reps)]
        finally:
            server.stop(60)
    idle = [x for rep in reps for x in rep["raw_ms"]["idle"]]
    busy = [x for rep in reps for x in rep["raw_ms"]["busy"]]
    idle_s, busy_s = summary(idle), summary(busy)
    return {
        "jobs_batch_size": batch_size,
        "idle": idle_s,
        "busy": busy_s,
        "busy_over_idle_p50": round(busy_s["p50_ms"] / idle_s["p50_ms"], 2),
        "busy_over_idle_p95": round(busy_s["p95_ms"] / idle_s["p95_ms"], 2),
        "busy_over_idle_p50_spread": spread((rep["busy_over_idle_p50"] for rep in reps), 3),
        "job_lines_per_s_alone": round(statistics.median(rep["job_lines_per_s_alone"] for rep in reps), 2),
        "job_lines_per_s_during_probes": round(
            statistics.median(rep["job_lines_per_s_during_probes"] for rep in reps), 2
        ),
        "job_lines_per_s_alone_spread": spread((rep["job_lines_per_s_alone"] for rep in reps), 2),
        "reps": reps,
    }


def markdown(report: dict[str, Any]) -> str:
    rows = [
        "| --jobs-batch-size | idle p50 / p95 ms | with a job p50 / p95 ms | ratio p50 (p95) "
        "| ratio p50 per repetition: median (min-max), reps | job lines/s alone "
        "| job lines/s during probes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        ratio = r["busy_over_idle_p50_spread"]
        rows.append(
            f"| {r['jobs_batch_size']} | {r['idle']['p50_ms']} / {r['idle']['p95_ms']} "
            f"| {r['busy']['p50_ms']} / {r['busy']['p95_ms']} "
            f"| {r['busy_over_idle_p50']}x ({r['busy_over_idle_p95']}x) "
            f"| {ratio['median']}x ({ratio['min']}-{ratio['max']}), {ratio['n']} | "
            f"{r['job_lines_per_s_alone']} | {r['job_lines_per_s_during_probes']} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser, quick="1 rep, 5 probes, a 2 s job phase", output="--out", model="tiny")
    parser.add_argument("--batch-sizes", default="1,4", help="comma-separated --jobs-batch-size values")
    parser.add_argument("--reps", type=int, default=3, help="idle / job / busy cycles per server")
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=100)
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--job-seconds", type=float, default=10)
    parser.add_argument("--state-words", type=int, default=80)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.reps, args.probes, args.lines, args.job_seconds = "1", 1, 5, 200, 2.0
    report = start_report("jobs", __file__, argv, quick=args.quick)
    report["settings"] = {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"
    }
    model = resolve_model(args.model)
    report["runs"] = [run_one(args, model, int(size)) for size in args.batch_sizes.split(",")]
    out = save(report, args.out, "jobs")
    table = markdown(report)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
