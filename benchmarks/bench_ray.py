"""Ray Serve scale-out on this machine: throughput of 2 model replicas vs 1, and the state-cache hit rate with
and without state-affinity routing, for a workload of repeated states.

Workload: ``--states`` distinct states of ~``--state-words`` words, each asked ``--schemas`` times with a new
question (a new schema about a known state: a state-cache hit when it reaches the replica that computed
it), shuffled with a fixed seed and sent at ``--concurrency``. Each configuration is a fresh
``clef serve --ray`` process with a local Ray head:

- ``1 replica`` (``--ray-num-cpus`` = every core, so it has the same threads as the two below together);
- ``2 replicas, state affinity`` (one core each, the default router);
- ``2 replicas, power of two`` (Ray Serve's default router, for comparison).

Hit rate = share of responses with ``X-Clef-State-Cache: hit``. Writes raw JSON and a markdown table.

Usage::

    python benchmarks/bench_ray.py --out benchmarks/results/ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
WORDS = ("order", "refund", "charged", "twice", "invoice", "login", "crash", "delivery", "late", "address")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(model: str, replicas: int, cpus: float, routing: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "clef_runtime.cli",
        "serve",
        "--ray",
        "--model",
        model,
        "--port",
        str(port),
        "--replicas",
        str(replicas),
        "--ray-num-cpus",
        str(cpus),
        "--ray-routing",
        routing,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("not ready in 600 s")
        try:
            ready = httpx.get(url + "/ready", timeout=5)
            if ready.status_code == 200 and ready.json()["replicas"]["up"] == replicas:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(1)


def workload(states: int, schemas: int, words: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(words)) + f" (case {n})" for n in range(states)]
    bodies = [
        {"state": text, "questions": {f"q{k}": {"type": "noul", "instructions": f"Question {k} about it?"}}}
        for text in texts
        for k in range(schemas)
    ]
    rng.shuffle(bodies)
    return bodies


def run(args: argparse.Namespace, label: str, replicas: int, cpus: float, routing: str) -> dict[str, Any]:
    process, url = start(args.model, replicas, cpus, routing)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            client.post("/v1/systemone", json=workload(1, 1, 20, 999)[0])  # warm the path
            bodies = workload(args.states, args.schemas, args.state_words, args.seed)
            started = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                responses = list(pool.map(lambda body: client.post("/v1/systemone", json=body), bodies))
            seconds = time.perf_counter() - started
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    outcomes = Counter(r.headers.get("x-clef-state-cache", "unknown") for r in responses)
    per_replica = Counter(r.headers["x-clef-replica"] for r in responses)
    return {
        "config": label,
        "replicas": replicas,
        "ray_num_cpus": cpus,
        "routing": routing,
        "requests": len(responses),
        "seconds": round(seconds, 2),
        "requests_per_s": round(len(responses) / seconds, 2),
        "hit_rate": round(outcomes.get("hit", 0) / len(responses), 3),
        "state_cache": dict(outcomes),
        "per_replica": dict(per_replica),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--states", type=int, default=8)
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--state-words", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cores = float(len(os.sched_getaffinity(0)))
    runs = [
        run(args, "1 replica", 1, cores, "state-affinity"),
        run(args, "2 replicas, state affinity", 2, cores / 2, "state-affinity"),
        run(args, "2 replicas, power of two", 2, cores / 2, "power-of-two"),
    ]
    base = runs[0]["requests_per_s"]
    for r in runs:
        r["throughput_vs_1_replica"] = round(r["requests_per_s"] / base, 2)
    lines = [
        "| configuration | req/s | vs 1 replica | state-cache hit rate | requests per replica |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['config']} | {r['requests_per_s']} | {r['throughput_vs_1_replica']}x "
            f"| {r['hit_rate']:.0%} | {sorted(r['per_replica'].values())} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        report = {"benchmark": "ray", "command": " ".join(sys.argv), "settings": vars(args), "runs": runs}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
