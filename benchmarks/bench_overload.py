"""Open-loop overload of ``clef serve``: arrivals at a multiple of the capacity measured in the same run, the
status mix, the answers' latency and queue time, and the server's memory, with and without a queue timeout.

Not a test. One server per configuration (``--queue-timeout-ms`` given, and none: the default), run one after
the other. For each of ``--reps`` repetitions: the capacity is measured again (closed loop at
``--capacity-concurrency``, answers per second and the median latency there, the *service time*), then
``--duration`` seconds of arrivals at ``--multiple`` times that capacity, on a fixed schedule. Then a soak
(``--soak`` seconds at the same multiple) on the queue-timeout server. Checks (exit 1 when one fails):

- only 200 / 429 / 503, every refusal with Retry-After, no transport error;
- with the queue timeout: no answer waited longer than it, and the answers' p99 latency is at most the
  queue timeout plus the p99 of their service time under the same load (``x-inference-time``: from the
  first engine step to the answer);
- resident memory from the end of a warm-up (``--warmup`` seconds of the same overload: the state cache,
  bounded by ``--cache-mb``, fills there) to the end: under 25% growth in a repetition, under 10% over the
  soak.

    python -m benchmarks.bench_overload --model medium --json benchmarks/results/overload-<date>.json
    python -m benchmarks.bench_overload --quick                  # smoke run on tiny (a minute)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import httpx
from devtools.harness import start_clef_server
from devtools.models import resolve_model
from devtools.open_loop import capacity, overload_failures, p99_bound_s, run_open_loop
from devtools.requests import generated_requests
from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import spread

RUN_RSS_TOLERANCE = 0.25
SOAK_RSS_TOLERANCE = 0.10
RUN_TIMEOUT_S = 900.0
"""Without a queue timeout a full queue takes minutes to drain on a slow model: the client waits for it."""


def bench_configuration(
    model: str, queue_timeout_ms: int | None, args: argparse.Namespace, seed: int
) -> tuple[dict[str, Any], list[str]]:
    """Repetitions (and the soak, with a queue timeout) against one fresh server. Returns its record and
    the failed checks."""
    settings: dict[str, Any] = {"log_level": "warning", "jobs": False, "cache_mb": args.cache_mb}
    if queue_timeout_ms is not None:
        settings["queue_timeout_ms"] = queue_timeout_ms
    server = start_clef_server(resolve_model(model), **settings)
    failures: list[str] = []
    label = f"queue timeout {queue_timeout_ms} ms" if queue_timeout_ms else "no queue timeout"
    reps = []
    try:
        # Warm-up: the same overload for --warmup seconds, so that the state cache (bounded by --cache-mb)
        # and the allocator's pools reach their working size before the memory baseline is read.
        measured = capacity(
            server.url, generated_requests(args.capacity_requests, seed=seed), args.capacity_concurrency
        )
        if args.warmup > 0:
            run_open_loop(
                server.url,
                generated_requests(args.workload_requests, seed=seed + 5),
                args.multiple * measured["per_s"],
                args.warmup,
                timeout_s=RUN_TIMEOUT_S,
            )
        warm = server.rss_bytes()
        for rep in range(args.reps):
            seed += 10
            bodies = generated_requests(args.capacity_requests, seed=seed)
            measured = capacity(server.url, bodies, args.capacity_concurrency)
            run = run_open_loop(
                server.url,
                generated_requests(args.workload_requests, seed=seed + 1),
                args.multiple * measured["per_s"],
                args.duration,
                rss=server.rss_bytes,
                timeout_s=RUN_TIMEOUT_S,
            )
            summary = run.summary(warm)
            found = overload_failures(
                run,
                queue_timeout_ms=queue_timeout_ms,
                rss_warm=warm,
                rss_tolerance=RUN_RSS_TOLERANCE,
                check_p99=True,
            )
            failures += [f"{label}, repetition {rep + 1}: {failure}" for failure in found]
            record = {
                "capacity_per_s": round(measured["per_s"], 3),
                "closed_loop_latency_p50_s": round(measured["service_s"], 4),
                "capacity_refused": int(measured["refused"]),
                "p99_bound_s": p99_bound_s(summary, queue_timeout_ms),
                **summary,
                "failures": found,
            }
            print(
                f"{label} rep {rep + 1}: capacity {record['capacity_per_s']}/s, "
                f"statuses {summary['statuses']}, p99 {summary.get('latency_s', {}).get('p99')} s, "
                f"rss growth {summary.get('rss_growth')}",
                flush=True,
            )
            reps.append(record)
        out: dict[str, Any] = {"queue_timeout_ms": queue_timeout_ms, "repetitions": reps}
        out["spread"] = {
            name: spread([_figure(rep, name) for rep in reps if _figure(rep, name) is not None])
            for name in ("capacity_per_s", "answered_per_s", "p99_s", "refused_share", "rss_growth")
            if any(_figure(rep, name) is not None for rep in reps)
        }
        if queue_timeout_ms is not None and args.soak > 0:
            soak = run_open_loop(
                server.url,
                generated_requests(args.workload_requests, seed=seed + 2),
                args.multiple * reps[-1]["capacity_per_s"],
                args.soak,
                rss=server.rss_bytes,
            )
            found = overload_failures(
                soak, queue_timeout_ms=queue_timeout_ms, rss_warm=warm, rss_tolerance=SOAK_RSS_TOLERANCE
            )
            failures += [f"soak: {failure}" for failure in found]
            out["soak"] = {**soak.summary(warm), "failures": found}
            print(
                f"soak {args.soak:.0f} s: {out['soak']['statuses']}, rss {out['soak'].get('rss_mb')}",
                flush=True,
            )
        out["state_cache_mb_end"] = _cache_mb(server.url)
    finally:
        if server.stop(120) != 0:
            failures.append(f"{label}: the server did not stop cleanly")
    return out, failures


def _cache_mb(url: str) -> float | None:
    """The server's state-cache bytes (``clef_cache_bytes``) in MiB, from /metrics."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("clef_cache_bytes "):
            return round(float(line.split()[1]) / 2**20, 1)
    return None


def _figure(rep: dict[str, Any], name: str) -> float | None:
    if name == "p99_s":
        return rep.get("latency_s", {}).get("p99")
    if name == "refused_share":
        refused = sum(n for status, n in rep["statuses"].items() if status in ("429", "503"))
        return refused / rep["sent"] if rep["sent"] else None
    value = rep.get(name)
    return None if value is None else float(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_run_arguments(parser, quick="tiny, 1 repetition of 5 s, a 10 s soak", model="medium")
    parser.add_argument("--queue-timeout-ms", type=int, default=2000)
    parser.add_argument("--multiple", type=float, default=2.5, help="arrival rate / measured capacity")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per repetition")
    parser.add_argument("--soak", type=float, default=120.0, help="seconds of the soak (0: none)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of overload before the baseline")
    parser.add_argument("--cache-mb", type=float, default=256.0, help="the servers' --cache-mb")
    parser.add_argument("--capacity-requests", type=int, default=32)
    parser.add_argument("--capacity-concurrency", type=int, default=4)
    parser.add_argument("--workload-requests", type=int, default=300, help="distinct bodies sent in turn")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.duration, args.soak, args.reps, args.queue_timeout_ms = "tiny", 5.0, 10.0, 1, 500
        args.warmup = 3.0

    report = start_report("bench_overload", __file__, argv, quick=args.quick)
    report["model"] = args.model
    report["settings"] = {
        key: getattr(args, key)
        for key in (
            "multiple",
            "duration",
            "soak",
            "reps",
            "warmup",
            "cache_mb",
            "capacity_requests",
            "capacity_concurrency",
        )
    }
    failures: list[str] = []
    configurations = []
    for index, timeout in enumerate((args.queue_timeout_ms, None)):
        record, found = bench_configuration(args.model, timeout, args, seed=1000 * (index + 1))
        configurations.append(record)
        failures += found
    report["configurations"] = configurations
    report["failures"] = failures
    publish(report, args.json)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
