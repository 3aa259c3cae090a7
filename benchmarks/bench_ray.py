"""Ray Serve scale-out on this machine: throughput of 2 model replicas vs 1, and the state-cache hit rate with
and without state-affinity routing, for a workload of repeated states.

Workload: ``--states`` distinct states of ~``--state-words`` words, each asked ``--schemas`` times with a new
question (a new schema about a known state: a state-cache hit when it reaches the replica that computed
it), shuffled with a fixed seed and sent at ``--concurrency``. Each configuration is a fresh
``clef serve --ray`` process with a local Ray head:

- ``1 replica`` (``--ray-num-cpus`` = every core, so it has the same threads as the two below together);
- ``2 replicas, state affinity`` (one core each, the default router);
- ``2 replicas, power of two`` (Ray Serve's default router, for comparison).

Hit rate = share of responses with ``X-Clef-State-Cache: hit``; a state *computed twice* is one that missed
on both replicas (every miss computes the state on the replica that answered). Each configuration sends
``--passes`` workloads (default 3, fresh states each) to its one server, and reports requests/s and hit rate
per pass with their spread. Writes raw JSON and a markdown table.

Usage::

    python -m benchmarks.bench_ray --out benchmarks/results/ray-2.json
    python -m benchmarks.bench_ray --quick --out /tmp/ray.json           # smoke run (a minute: Ray starts)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from devtools.harness import ServerProcess, start_clef_server
from devtools.models import resolve_model
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import spread

WORDS = ("order", "refund", "charged", "twice", "invoice", "login", "crash", "delivery", "late", "address")


def start(model: str, replicas: int, cpus: float, routing: str, log_path: Path) -> ServerProcess:
    """``clef serve --ray`` with a local Ray head, ready once every replica is up."""
    return start_clef_server(
        model,
        log_path=log_path,
        ready=lambda response: response.json().get("replicas", {}).get("up") == replicas,
        env={"RAY_USAGE_STATS_ENABLED": "0"},
        new_session=True,
        ray=True,
        replicas=replicas,
        ray_num_cpus=cpus,
        ray_routing=routing,
        log_level="warning",
        jobs=False,
    )


def workload(states: int, schemas: int, words: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(words)) + f" (case {seed}-{n})" for n in range(states)]
    bodies = [
        {"state": text, "questions": {f"q{k}": {"type": "noul", "instructions": f"Question {k} about it?"}}}
        for text in texts
        for k in range(schemas)
    ]
    rng.shuffle(bodies)
    return bodies


def one_pass(client: httpx.Client, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One shuffled workload at ``--concurrency``: throughput, hit rate, where each state was computed."""
    bodies = workload(args.states, args.schemas, args.state_words, seed)
    started = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        responses = list(pool.map(lambda body: client.post("/v1/systemone", json=body), bodies))
    seconds = time.perf_counter() - started
    failed = [r.text for r in responses if r.status_code != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    outcomes = Counter(r.headers.get("x-clef-state-cache", "unknown") for r in responses)
    computed_on: dict[str, set[str]] = defaultdict(set)
    for body, response in zip(bodies, responses, strict=True):
        if response.headers.get("x-clef-state-cache") != "hit":
            computed_on[body["state"]].add(response.headers["x-clef-replica"])
    return {
        "requests": len(responses),
        "seconds": round(seconds, 3),
        "requests_per_s": round(len(responses) / seconds, 2),
        "hit_rate": round(outcomes.get("hit", 0) / len(responses), 3),
        "state_cache": dict(outcomes),
        "states": args.states,
        "states_computed_on_both_replicas": sum(len(replicas) > 1 for replicas in computed_on.values()),
        "per_replica": dict(Counter(r.headers["x-clef-replica"] for r in responses)),
    }


def run(args: argparse.Namespace, label: str, replicas: int, cpus: float, routing: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = start(resolve_model(args.model), replicas, cpus, routing, Path(tmp) / "server.log")
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:
                client.post("/v1/systemone", json=workload(1, 1, 20, 999)[0])  # warm the path
                passes = [one_pass(client, args, args.seed + number) for number in range(args.passes)]
        finally:
            server.stop(120)
    return {
        "config": label,
        "replicas": replicas,
        "ray_num_cpus": cpus,
        "routing": routing,
        "requests_per_s": round(statistics.median(p["requests_per_s"] for p in passes), 2),
        "hit_rate": round(statistics.median(p["hit_rate"] for p in passes), 3),
        "requests_per_s_spread": spread((p["requests_per_s"] for p in passes), 2),
        "hit_rate_spread": spread((p["hit_rate"] for p in passes), 3),
        "passes": passes,
    }


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| configuration | req/s: median (min-max), passes | vs 1 replica | state-cache hit rate (min-max) "
        "| states computed on both replicas, per pass | requests per replica, first pass |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        rate, hits = r["requests_per_s_spread"], r["hit_rate_spread"]
        twice = [p["states_computed_on_both_replicas"] for p in r["passes"]]
        lines.append(
            f"| {r['config']} | {rate['median']} ({rate['min']}-{rate['max']}), {rate['n']} "
            f"| {r['throughput_vs_1_replica']}x | {hits['median']:.0%} ({hits['min']:.0%}-{hits['max']:.0%}) "
            f"| {twice} of {r['passes'][0]['states']} | {sorted(r['passes'][0]['per_replica'].values())} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser, quick="2 states x 2 schemas, one pass", output="--out", model="tiny")
    parser.add_argument("--states", type=int, default=8)
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--state-words", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--passes", type=int, default=3, help="workloads per configuration (fresh states)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.states, args.schemas, args.state_words, args.passes = 2, 2, 50, 1
    report = start_report("ray", __file__, argv, quick=args.quick)
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cores = float(len(os.sched_getaffinity(0)))
    runs = [
        run(args, "1 replica", 1, cores, "state-affinity"),
        run(args, "2 replicas, state affinity", 2, cores / 2, "state-affinity"),
        run(args, "2 replicas, power of two", 2, cores / 2, "power-of-two"),
    ]
    base = runs[0]["requests_per_s"]
    for r in runs:
        r["throughput_vs_1_replica"] = round(r["requests_per_s"] / base, 2)
    report["runs"] = runs
    out = save(report, args.out, "ray")
    table = markdown(runs)
    print(table)
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
