"""HTTP server benchmark: requests/s and p50/p95 latency of ``clef serve`` at several client concurrencies.

For each model (``null``, ``tiny``, and the hidden-512 ``medium`` benchmark model) two servers run side by
side, one with dynamic batching (the default) and one with ``--deterministic`` (every request alone), and a
mixed workload is sent at concurrency 1, 4 and 16, alternating between the two servers round by round so
that other load on the machine affects both alike. The model "null" is an instant engine served through the
real server code (`devtools.engine_server`): it measures the server's own overhead per request (HTTP +
body parsing + validation + scheduling + serialisation), read from each answer's ``x_latency_ms``.

Every round sends fresh requests and is kept on its own: a row reports the figures over all rounds and
their spread over rounds (requests/s, p50, the server's own p50), ``--rounds`` (default 3) of them.

    python -m benchmarks.bench_server                       # everything, a new file in benchmarks/results/
    python -m benchmarks.bench_server --models null --rounds 5 --out /tmp/server-null.json
    python -m benchmarks.bench_server --quick               # smoke run (null and tiny, seconds)

Not a test: numbers depend on the machine. Each server process is started fresh, warmed with a few
requests, and stopped with SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devtools.harness import Load, ServerProcess, engine_launcher, post_all, start_clef_server
from devtools.models import resolve_model
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import percentile, spread

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


def summarize(runs: Sequence[Load]) -> dict[str, Any]:
    """One table row from several rounds: total requests / total seconds, latency percentiles over all
    requests, and the spread over rounds of requests/s, p50 and the server's own p50."""
    latencies = [x for run in runs for x in run.latencies_s]
    server_ms = [x for run in runs for x in run.server_ms]
    seconds = sum(run.seconds for run in runs)
    return {
        "requests": len(latencies),
        "rounds": len(runs),
        "errors": sum(run.errors for run in runs),
        "seconds": round(seconds, 3),
        "requests_per_s": round(len(latencies) / seconds, 2),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p95_ms": round(1000 * percentile(latencies, 0.95), 1),
        "server_p50_ms": round(statistics.median(server_ms), 2) if server_ms else None,
        "requests_per_s_spread": spread((len(run.latencies_s) / run.seconds for run in runs), 2),
        "p50_ms_spread": spread((1000 * statistics.median(run.latencies_s) for run in runs), 2),
        "server_p50_ms_spread": (
            spread((statistics.median(run.server_ms) for run in runs), 3)
            if all(run.server_ms for run in runs)
            else None
        ),
    }


# ------------------------------------------------------------------------------------- the null engine


class _Record:
    truncated_state_tokens = 0

    def __init__(self, tokens: int) -> None:
        self.input_tokens = tokens


class _Prepared:
    def __init__(self, request: Any, record: _Record) -> None:
        self.request, self.record = request, record


class NullEngine:
    """The server's engine contract (`clef_runtime.engine.contract`), answering at once: what is left of a
    request's time is the server's own."""

    name, description, release_date, untrained, max_length = "null", "instant answers", None, True, 16384
    calibration_card = None
    device, weight_mode = "cpu", "none"
    step_tokens = 16384

    def __init__(self) -> None:
        from clef_runtime.options import EngineOptions

        self.options = EngineOptions()

    def prepare(self, request: Any, *, max_length: int | None = None) -> _Prepared:
        from clef_runtime.protocol.systemone import parse_request

        parsed = parse_request(request)
        return _Prepared(parsed, _Record(len(str(parsed.state)) // 4 + 40))

    def warmup(self, *, max_rows: int = 32) -> None:
        pass

    def runner(self) -> Any:
        from clef_runtime.engine.loop import WholeRequestRunner

        return WholeRequestRunner(self.decide_encoded, lambda item: item.record.input_tokens)

    def cache_stats(self) -> dict[str, int]:
        return {}

    def replica_status(self) -> None:
        return None

    def prepare_compute_thread(self) -> None:
        pass

    def decide_encoded(self, items: Sequence[_Prepared]) -> list[Any]:
        return [self._answer(item.request, item.record) for item in items]

    @staticmethod
    def _answer(request: Any, record: _Record) -> Any:
        from clef_runtime.engine.decision import Decision

        answers: dict[str, Any] = {}
        for qid, question in request.questions.items():
            if question.type == "noul":
                answers[qid] = {"type": "noul", "noul": 0.5}
                continue
            keys = (
                list(question.criteria) if question.type == "choice" else list(range(len(question.criteria)))
            )
            p = round(1 / len(keys), 4)
            probabilities = {str(key): p for key in keys}
            if question.type == "choice":
                answers[qid] = {"type": "choice", "choice": keys[0], "confidence": p}
            else:
                legend = {str(i): criterion for i, criterion in enumerate(question.criteria)}
                answers[qid] = {"type": "score", "score": round((len(keys) - 1) / 2, 4), "confidence": p}
                answers[qid]["legend"] = legend
            answers[qid]["probabilities"] = probabilities
        return Decision(model=request.model or "null", answers=answers, input_tokens=record.input_tokens)


def null_engine() -> NullEngine:
    """The factory `devtools.engine_server` calls in the server process."""
    return NullEngine()


# ------------------------------------------------------------------------------------------ the runs


def start(model: str, deterministic: bool, log_path: Path) -> ServerProcess:
    """One benchmarked server: ``null`` through the engine launcher, other models through ``clef serve``."""
    # No batch jobs: two servers run side by side, and a jobs database belongs to one server.
    settings: dict[str, Any] = {"log_level": "warning", "deterministic": deterministic or None, "jobs": False}
    if model == "null":
        launcher = engine_launcher("benchmarks.bench_server:null_engine")
        return start_clef_server("null", launcher=launcher, log_path=log_path, **settings)
    return start_clef_server(resolve_model(model), log_path=log_path, **settings)


def bench_model(
    model: str, requests: int, rounds: int, concurrencies: Sequence[int], tmp_dir: Path
) -> list[dict[str, Any]]:
    """Both modes of one model, started side by side and measured in alternating rounds (batching,
    deterministic, batching, ...) so that load from elsewhere on a shared machine hits both alike. Every
    round sends requests of its own (the engine's state cache would answer a repeated state without its
    prefill); a last "warm" row replays requests already sent, ``rounds`` times, to show the cache."""
    servers: dict[str, ServerProcess] = {}
    try:
        for mode in ("batching", "deterministic"):
            servers[mode] = start(model, mode == "deterministic", tmp_dir / f"{model}-{mode}.log")
            post_all(servers[mode].url, workload(4, seed=999), 1)  # warm-up
        rows = []
        seed = 0
        sent: list[dict[str, Any]] = []
        for concurrency in concurrencies:
            runs: dict[str, list[Load]] = {"batching": [], "deterministic": []}
            for _ in range(rounds):
                seed += 1
                sent = workload(requests, seed=seed)
                for mode, server in servers.items():
                    runs[mode].append(post_all(server.url, sent, concurrency))
            rows += _rows(model, concurrency, "cold", runs)
        warm = {
            mode: [post_all(server.url, sent, concurrencies[-1]) for _ in range(rounds)]
            for mode, server in servers.items()
        }
        return rows + _rows(model, concurrencies[-1], "warm (repeat)", warm)
    finally:
        for server in servers.values():
            server.stop(120)


def _rows(model: str, concurrency: int, cache: str, runs: dict[str, list[Load]]) -> list[dict[str, Any]]:
    rows = []
    for mode, mode_runs in runs.items():
        row = {
            "model": model,
            "mode": mode,
            "concurrency": concurrency,
            "cache": cache,
            **summarize(mode_runs),
        }
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_spread")}), flush=True)
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["null", "tiny", "medium"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per concurrency level")
    add_run_arguments(parser, quick="null and tiny, 4 requests, 1 round", output="--out")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.concurrency, args.requests, args.rounds = ["null", "tiny"], [1, 4], 4, 1

    report = start_report("bench_server", __file__, argv, quick=args.quick)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="clef-bench-") as tmp:
        for model in args.models:
            print(f"== {model}", flush=True)
            rows += bench_model(model, args.requests, args.rounds, args.concurrency, Path(tmp))
    report["workload"] = {
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "questions": "1-4 mixed",
        "state_words": "10-400",
    }
    report["rows"] = rows
    out = save(report, args.out, "server")
    print(
        "\n| model | mode | concurrency | state cache | req/s (min-max) | p50 ms | p95 ms | server p50 ms |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for row in rows:
        server_p50 = row["server_p50_ms"] if row["server_p50_ms"] is not None else "-"
        rate = row["requests_per_s_spread"]
        print(
            f"| {row['model']} | {row['mode']} | {row['concurrency']} | {row['cache']} "
            f"| {row['requests_per_s']} ({rate['min']}-{rate['max']}) | {row['p50_ms']} | {row['p95_ms']} "
            f"| {server_p50} |"
        )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
