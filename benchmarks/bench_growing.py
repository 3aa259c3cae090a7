"""Growing-state benchmark: a state that extends one already seen, through a real server, against cold.

Two ``clef serve`` processes run side by side on the medium random model (hidden 512, 8 layers, built here
as in bench_server.py): one with the state cache (the prefix tree), one with ``--cache-mb 0`` (every state
computed from the prompt prefix). Requests alternate between them so that other load on the machine affects
both alike.

1. *Extend*: a ~2,000-token message-array state is sent once (it fills the cache; not timed), then the same
   conversation with one ~60-token message appended and a new schema is timed on both servers. The ratio
   cold / cached is the speed-up (target: >= 5x). A fresh conversation per round.
2. *Agent*: 20 steps of a growing history (a ~1,000-token start, one ~60-token message more each step, a
   new schema each step), sent step by step to both servers; the total times are compared.

    python benchmarks/bench_growing.py                 # results in benchmarks/results/growing.json
    python benchmarks/bench_growing.py --rounds 3 --steps 10

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_harness import free_port, make_medium, start_server, stop_server

REPO = Path(__file__).resolve().parents[1]
WORDS = ["charged", "twice", "refund", "order", "invoice", "march", "please", "today", "bank", "dispute"]
WORDS += ["shipping", "late", "broken", "screen", "login", "password", "upgrade", "plan", "thanks", "again"]


def message(rng: random.Random, words: int, role: str) -> dict[str, str]:
    """One chat message of about ``words`` + 10 tokens once rendered."""
    return {"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(words))}


def conversation(rng: random.Random, tokens: int) -> list[dict[str, str]]:
    """A message array of about ``tokens`` tokens (messages of ~60 tokens)."""
    return [message(rng, 50, "user" if i % 2 == 0 else "assistant") for i in range(max(1, tokens // 60))]


def schema(rng: random.Random, step: int) -> dict[str, Any]:
    """A new schema per request: 3 questions whose texts change with ``step``."""
    teams = rng.sample(["billing", "tech", "sales", "legal", "support"], 3)
    return {
        f"refund_{step}": {
            "type": "noul",
            "instructions": f"Step {step}: does the customer want money back?",
        },
        f"team_{step}": {"type": "choice", "instructions": "Which team?", "criteria": dict.fromkeys(teams)},
        f"urgency_{step}": {"type": "score", "criteria": ["can wait", "this week", "today"]},
    }


def post(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any], httpx.Headers]:
    started = time.perf_counter()
    response = client.post(url, json=body, timeout=600)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.json(), response.headers


def bench_extend(urls: dict[str, str], rounds: int, state_tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    rows = []
    with httpx.Client() as client:
        for number in range(rounds):
            history = conversation(rng, state_tokens)
            base = {"state": history, "questions": schema(rng, 0)}
            extended = {"state": [*history, message(rng, 50, "user")], "questions": schema(rng, number + 1)}
            post(client, urls["cached"], base)  # fills the cache (the cold server needs no warming)
            row: dict[str, Any] = {}
            order = ["cached", "cold"] if number % 2 == 0 else ["cold", "cached"]
            for name in order:
                seconds, body, headers = post(client, urls[name], extended)
                row[f"{name}_s"] = round(seconds, 4)
                row[f"{name}_report"] = headers.get("x-clef-state-cache")
                row[f"{name}_cached_tokens"] = (
                    body["usage"].get("input_tokens_details", {}).get("cached_tokens")
                )
                row["input_tokens"] = body["usage"]["input_tokens"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    cached = statistics.median(r["cached_s"] for r in rows)
    cold = statistics.median(r["cold_s"] for r in rows)
    return {
        "rounds": rows,
        "median_cached_s": cached,
        "median_cold_s": cold,
        "speedup": round(cold / cached, 2),
    }


def bench_agent(urls: dict[str, str], steps: int, start_tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed + 1)
    history = conversation(rng, start_tokens)
    totals = {"cached": 0.0, "cold": 0.0}
    rows = []
    with httpx.Client() as client:
        for step in range(steps):
            history = [*history, message(rng, 50, "tool" if step % 2 else "assistant")]
            body = {"state": list(history), "questions": schema(rng, step)}
            row: dict[str, Any] = {"step": step}
            for name in ["cached", "cold"] if step % 2 == 0 else ["cold", "cached"]:
                seconds, answer, headers = post(client, urls[name], body)
                totals[name] += seconds
                row[f"{name}_s"] = round(seconds, 4)
                row[f"{name}_report"] = headers.get("x-clef-state-cache")
                row["input_tokens"] = answer["usage"]["input_tokens"]
            rows.append(row)
    print(json.dumps({"agent_totals": totals}), flush=True)
    return {
        "steps": rows,
        "total_cached_s": round(totals["cached"], 3),
        "total_cold_s": round(totals["cold"], 3),
        "speedup": round(totals["cold"] / totals["cached"], 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--state-tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--agent-start-tokens", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "growing.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        print("building the medium random model ...", flush=True)
        model = make_medium(tmp_dir / "medium")
        servers: dict[str, Any] = {}
        urls: dict[str, str] = {}
        try:
            for name, cache_mb in (("cached", "1024"), ("cold", "0")):
                port = free_port()
                command = [sys.executable, "-m", "clef_runtime.cli", "serve", "--model", str(model)]
                command += ["--port", str(port), "--log-level", "warning", "--cache-mb", cache_mb]
                servers[name] = start_server(command, port, tmp_dir / f"{name}.log")
                urls[name] = f"http://127.0.0.1:{port}/v1/systemone"
            extend = bench_extend(urls, args.rounds, args.state_tokens, args.seed)
            agent = bench_agent(urls, args.steps, args.agent_start_tokens, args.seed)
        finally:
            for process in servers.values():
                stop_server(process)

    result = {
        "benchmark": "growing states through the server (medium random model, hidden 512, 8 layers)",
        "command": "python benchmarks/bench_growing.py " + " ".join(argv or sys.argv[1:]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "extend": extend,
        "agent": agent,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"extend: cached {extend['median_cached_s']:.3f} s, cold {extend['median_cold_s']:.3f} s, "
        f"{extend['speedup']}x; agent ({args.steps} steps): cached {agent['total_cached_s']} s, "
        f"cold {agent['total_cold_s']} s, {agent['speedup']}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
