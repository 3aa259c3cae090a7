"""HTTP server benchmark: requests/s and p50/p95 latency of ``clef serve`` at several client concurrencies.

For each model (``tiny``, and the ``medium`` random model of ``engine_bench.py``) two servers run
side by side, one with dynamic batching (the default) and one with ``--deterministic`` (every request alone),
and a mixed workload is sent at concurrency 1, 4 and 16, alternating between the two servers round by
round so that other load on the machine affects both alike. The model "null" is an instant engine: it
measures the server's own overhead per request (HTTP + body parsing + validation + scheduling +
serialisation).

    python benchmarks/bench_server.py            # everything; results in benchmarks/results/server.json
    python benchmarks/bench_server.py --models tiny --requests 32 --rounds 3 --concurrency 1 4

Not a test: numbers depend on the machine. Each server process is started fresh, warmed with a few
requests, and stopped with SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.serving: the server-start helper the tests use too
    sys.path.insert(0, str(REPO))

from tests.serving import ServerProcess, free_port, start_server_process  # noqa: E402

QUESTIONS = [
    ("refund", {"type": "noul", "instructions": "Is the customer asking for money back?"}),
    (
        "team",
        {
            "type": "choice",
            "instructions": "Which team?",
            "criteria": {"billing": "charges", "tech": None, "sales": None},
        },
    ),
    (
        "urgency",
        {"type": "score", "instructions": "How urgent?", "criteria": ["can wait", "this week", "today"]},
    ),
    ("polite", {"type": "noul", "instructions": "Is the message polite?"}),
]
WORDS = ["charged", "twice", "refund", "order", "invoice", "march", "please", "today", "bank", "dispute"]


def workload(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` mixed requests: 1-4 questions, states of 10-400 words (about 15-600 tokens)."""
    rng = random.Random(seed)
    bodies = []
    for i in range(count):
        words = rng.randint(10, 400)
        state = f"Ticket {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        questions = dict(QUESTIONS[: rng.randint(1, len(QUESTIONS))])
        bodies.append({"model": "jev-latest", "state": state, "questions": questions})
    return bodies


def run_load(url: str, bodies: Sequence[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """Send every body once with ``concurrency`` client threads (one keep-alive connection each).

    Returns the raw measurements: wall seconds, per-request latencies, the server's own x_latency_ms."""
    clients = [httpx.Client(base_url=url, timeout=600) for _ in range(concurrency)]
    latencies: list[float] = []
    server_ms: list[float] = []
    errors = 0

    def worker(index: int) -> None:
        nonlocal errors
        client = clients[index]
        for body in bodies[index::concurrency]:
            started = time.perf_counter()
            response = client.post("/v1/systemone", json=body)
            latencies.append(time.perf_counter() - started)
            if response.status_code != 200:
                errors += 1
            elif "x_latency_ms" in response.json():
                server_ms.append(response.json()["x_latency_ms"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    elapsed = time.perf_counter() - started
    for client in clients:
        client.close()
    return {"seconds": elapsed, "latencies": latencies, "server_ms": server_ms, "errors": errors}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One table row from several rounds: total requests / total seconds, latency percentiles over all."""
    latencies = sorted(x for run in runs for x in run["latencies"])
    server_ms = [x for run in runs for x in run["server_ms"]]
    seconds = sum(run["seconds"] for run in runs)
    return {
        "requests": len(latencies),
        "errors": sum(run["errors"] for run in runs),
        "seconds": round(seconds, 3),
        "requests_per_s": round(len(latencies) / seconds, 2),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p95_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 1),
        "server_p50_ms": round(statistics.median(server_ms), 1) if server_ms else None,
    }


# ------------------------------------------------------------------------------------- the null engine


NULL_SERVER = """
import sys
from clef_runtime.options import EngineOptions
from clef_runtime.protocol.systemone import parse_request
from clef_runtime.server.cli import configure_logging, serve
from clef_runtime.server.settings import ServerSettings

class Record:
    truncated_state_tokens = 0
    def __init__(self, tokens): self.input_tokens = tokens

class Prepared:
    def __init__(self, request, record): self.request, self.record = request, record

class NullEngine:  # the server's engine contract (clef_runtime.engine.contract), answering at once
    name, description, release_date, untrained, max_length = "null", "instant answers", None, True, 16384
    options = EngineOptions()
    def prepare(self, request, *, max_length=None):
        parsed = parse_request(request)
        return Prepared(parsed, Record(len(str(parsed.state)) // 4 + 40))
    def warmup(self): pass
    def cache_stats(self): return {}
    def decide_encoded(self, items):
        out = []
        for request, record in ((item.request, item.record) for item in items):
            answers = {}
            for qid, q in request.questions.items():
                if q.type == "noul":
                    answers[qid] = {"type": "noul", "noul": 0.5}
                elif q.type == "choice":
                    keys = list(q.criteria); p = round(1 / len(keys), 4)
                    answers[qid] = {"type": "choice", "choice": keys[0], "confidence": p,
                                    "probabilities": {k: p for k in keys}}
                else:
                    n = len(q.criteria); p = round(1 / n, 4)
                    answers[qid] = {"type": "score", "score": round((n - 1) / 2, 4), "confidence": p,
                                    "legend": {str(i): c for i, c in enumerate(q.criteria)},
                                    "probabilities": {str(i): p for i in range(n)}}
            out.append({"model": request.model or "null", "answers": answers,
                        "usage": {"input_tokens": record.input_tokens, "output_tokens": 0}})
        return out

configure_logging("warning")
sys.exit(serve(ServerSettings(model="null", port=int(sys.argv[1]), deterministic=sys.argv[2] == "1"),
               engine_factory=lambda s: NullEngine()))
"""


def bench_model(
    model: str, requests: int, rounds: int, concurrencies: Sequence[int], tmp_dir: Path
) -> list[dict[str, Any]]:
    """Both modes of one model, started side by side and measured in alternating rounds (batching,
    deterministic, batching, ...) so that load from elsewhere on a shared machine hits both alike. Every
    round sends requests of its own (the engine's state cache would answer a repeated state without its
    prefill); a last "warm" row replays requests already sent, to show the cache."""
    servers: dict[str, ServerProcess] = {}
    try:
        for mode in ("batching", "deterministic"):
            port = free_port()
            command = server_command(model, port, mode == "deterministic", tmp_dir)
            log_path = tmp_dir / f"{model}-{mode}.log"
            servers[mode] = start_server_process(command, port, log_path=log_path, timeout=600)
            run_load(servers[mode].url, workload(4, seed=999), 1)  # warm-up
        rows = []
        seed = 0
        sent: list[dict[str, Any]] = []
        for concurrency in concurrencies:
            runs: dict[str, list[dict[str, Any]]] = {"batching": [], "deterministic": []}
            for _ in range(rounds):
                seed += 1
                sent = workload(requests, seed=seed)
                for mode, server in servers.items():
                    runs[mode].append(run_load(server.url, sent, concurrency))
            for mode, mode_runs in runs.items():
                row = {
                    "model": model,
                    "mode": mode,
                    "concurrency": concurrency,
                    "cache": "cold",
                    **summarize(mode_runs),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        for mode, server in servers.items():
            row = {
                "model": model,
                "mode": mode,
                "concurrency": concurrencies[-1],
                "cache": "warm (repeat)",
                **summarize([run_load(server.url, sent, concurrencies[-1])]),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows
    finally:
        for server in servers.values():
            server.stop(120)


def server_command(model: str, port: int, deterministic: bool, tmp_dir: Path) -> list[str]:
    """The command line of one benchmarked server."""
    if model == "null":
        return [sys.executable, "-c", NULL_SERVER, str(port), "1" if deterministic else "0"]
    spec = model
    if model == "medium":
        from engine_bench import ensure_medium_checkpoint  # benchmarks/: the one medium model

        spec = str(ensure_medium_checkpoint())
    command = [sys.executable, "-m", "clef_runtime.cli", "serve", "--model", spec, "--port", str(port)]
    command += ["--log-level", "warning"]
    return command + (["--deterministic"] if deterministic else [])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["null", "tiny", "medium"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per concurrency level")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "server.json")
    args = parser.parse_args(argv)

    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="clef-bench-") as tmp:
        for model in args.models:
            print(f"== {model}", flush=True)
            rows += bench_model(model, args.requests, args.rounds, args.concurrency, Path(tmp))
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_before_after": [load_before, os.getloadavg()],
        },
        "workload": {
            "requests_per_round": args.requests,
            "rounds": args.rounds,
            "questions": "1-4 mixed",
            "state_words": "10-400",
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| model | mode | concurrency | state cache | req/s | p50 ms | p95 ms | server p50 ms |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for row in rows:
        server_p50 = row["server_p50_ms"] if row["server_p50_ms"] is not None else "-"
        print(
            f"| {row['model']} | {row['mode']} | {row['concurrency']} | {row['cache']} "
            f"| {row['requests_per_s']} | {row['p50_ms']} | {row['p95_ms']} | {server_p50} |"
        )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
