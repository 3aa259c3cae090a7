"""Interactive latency while a large batch job runs, and the job's throughput, through a real server.

For each ``--jobs-batch-size`` given, one ``clef serve`` process (the built-in tiny model unless ``--model``)
is started, then, all in the same run:

1. idle: ``--probes`` interactive requests, one at a time with ``--gap-ms`` between them;
2. job only: a job of ``--lines`` lines is submitted and its throughput measured for ``--job-seconds``;
3. busy: the same interactive probes while that job keeps running, with the job's throughput meanwhile.

Every request has its own state (no state-cache hits), ~``--state-words`` words, three questions. The
requirement is busy p50 <= 1.5x idle p50. Writes raw JSON and a markdown table.

Usage::

    python benchmarks/bench_jobs.py --out benchmarks/results/jobs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "criteria": {"billing": "charges", "tech": "bugs", "sales": None}},
    "urgency": {"type": "score", "criteria": ["can wait", "this week", "today"]},
}
WORDS = [
    "the",
    "customer",
    "writes",
    "that",
    "the",
    "invoice",
    "shows",
    "a",
    "double",
    "charge",
    "and",
    "the",
    "app",
    "crashes",
    "on",
    "login",
]


def state(tag: str, words: int) -> str:
    body = " ".join(WORDS[i % len(WORDS)] for i in range(words))
    return f"[{tag}] {body}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model: str, batch_size: int, db: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "clef_runtime.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--jobs-db",
        str(db),
        "--jobs-batch-size",
        str(batch_size),
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise RuntimeError(process.stderr.read().decode() if process.stderr else "server died")
        if time.monotonic() > deadline:
            raise RuntimeError("server not ready in 300 s")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


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
    ordered = sorted(latencies)
    return {
        "p50_ms": round(statistics.median(ordered), 1),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1),
        "mean_ms": round(statistics.fmean(ordered), 1),
    }


def run_one(args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_server(args.model, batch_size, Path(tmp) / "jobs.sqlite3")
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                probe(client, 3, 0.0, args.state_words, "warm")
                idle = probe(client, args.probes, args.gap_ms / 1000, args.state_words, "idle")
                lines = "\n".join(
                    json.dumps(
                        {
                            "custom_id": str(i),
                            "state": state(f"job-{i}", args.state_words),
                            "questions": QUESTIONS,
                        }
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
                busy = probe(client, args.probes, args.gap_ms / 1000, args.state_words, "busy")
                during = (done_lines(client, job["id"]) - start_done) / (time.perf_counter() - started)
                client.delete(f"/v1/jobs/{job['id']}")
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    idle_s, busy_s = summary(idle), summary(busy)
    return {
        "jobs_batch_size": batch_size,
        "idle": idle_s,
        "busy": busy_s,
        "busy_over_idle_p50": round(busy_s["p50_ms"] / idle_s["p50_ms"], 2),
        "busy_over_idle_p95": round(busy_s["p95_ms"] / idle_s["p95_ms"], 2),
        "job_lines_per_s_alone": round(alone, 2),
        "job_lines_per_s_during_probes": round(during, 2),
        "raw_ms": {"idle": [round(x, 1) for x in idle], "busy": [round(x, 1) for x in busy]},
    }


def markdown(report: dict[str, Any]) -> str:
    rows = [
        "| --jobs-batch-size | idle p50 / p95 ms | with a job p50 / p95 ms | ratio p50 (p95) "
        "| job lines/s alone | job lines/s during probes |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        rows.append(
            f"| {r['jobs_batch_size']} | {r['idle']['p50_ms']} / {r['idle']['p95_ms']} "
            f"| {r['busy']['p50_ms']} / {r['busy']['p95_ms']} "
            f"| {r['busy_over_idle_p50']}x ({r['busy_over_idle_p95']}x) | "
            f"{r['job_lines_per_s_alone']} | {r['job_lines_per_s_during_probes']} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-sizes", default="1,4", help="comma-separated --jobs-batch-size values")
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--gap-ms", type=float, default=100)
    parser.add_argument("--lines", type=int, default=3000)
    parser.add_argument("--job-seconds", type=float, default=10)
    parser.add_argument("--state-words", type=int, default=80)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs = [run_one(args, int(size)) for size in args.batch_sizes.split(",")]
    report = {
        "benchmark": "jobs",
        "command": " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
    }
    table = markdown(report)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
