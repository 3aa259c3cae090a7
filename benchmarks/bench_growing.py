"""Growing-state benchmark: a state that extends one already seen, through a real server, against cold.

Two ``clef serve`` processes run side by side on the ``medium`` benchmark model (hidden 512, 8 layers;
`devtools.models`): one with the state cache (the prefix tree), one with ``--cache-mb 0`` (every
state computed from the prompt prefix). Requests alternate between them so that other load on the machine
affects both alike.

1. *Extend*: a ~2,000-token message-array state is sent once (it fills the cache; not timed), then the same
   conversation with one ~60-token message appended and a new schema is timed on both servers. The ratio
   cold / cached is the speed-up (target: >= 5x). A fresh conversation per round.
2. *Agent*: 20 steps of a growing history (a ~1,000-token start, one ~60-token message more each step, a
   new schema each step), sent step by step to both servers; the total times are compared. Repeated
   ``--agent-reps`` times (default 3) with a fresh history each.

Each speed-up is reported with its spread over the rounds (extend) and the repetitions (agent).

    python -m benchmarks.bench_growing                 # a new results file in benchmarks/results/
    python -m benchmarks.bench_growing --rounds 3 --steps 10 --output /tmp/growing.json
    python -m benchmarks.bench_growing --quick --output /tmp/growing.json   # smoke run on tiny (seconds)

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from devtools.harness import ServerProcess, start_clef_server
from devtools.models import resolve_model
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import spread

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
        "speedup_spread": spread((r["cold_s"] / r["cached_s"] for r in rows), 2),
    }


def bench_agent(urls: dict[str, str], steps: int, start_tokens: int, seed: int, reps: int) -> dict[str, Any]:
    """``reps`` agent runs, each with a fresh history; the total times of each and their spread."""
    runs = [_agent_run(urls, steps, start_tokens, seed + 1 + rep) for rep in range(reps)]
    return {
        "runs": runs,
        "total_cached_s": round(statistics.median(run["total_cached_s"] for run in runs), 3),
        "total_cold_s": round(statistics.median(run["total_cold_s"] for run in runs), 3),
        "speedup": round(statistics.median(run["speedup"] for run in runs), 2),
        "speedup_spread": spread((run["speedup"] for run in runs), 2),
    }


def _agent_run(urls: dict[str, str], steps: int, start_tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
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


def start_servers(model: str, tmp_dir: Path) -> dict[str, ServerProcess]:
    """The cached (1 GiB state cache) and the cold (no state cache) server, side by side."""
    servers: dict[str, ServerProcess] = {}
    try:
        for name, cache_mb in (("cached", 1024), ("cold", 0)):
            servers[name] = start_clef_server(
                model, log_path=tmp_dir / f"{name}.log", log_level="warning", cache_mb=cache_mb, jobs=False
            )
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_run_arguments(parser, quick="tiny, short states, one repetition", output="--output", model="medium")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--state-tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--agent-start-tokens", type=int, default=1000)
    parser.add_argument("--agent-reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.state_tokens = "tiny", 1, 300
        args.steps, args.agent_start_tokens, args.agent_reps = 3, 200, 1

    model = resolve_model(args.model)
    result = start_report("bench_growing", __file__, argv, quick=args.quick)
    result["description"] = f"growing states through the server ({args.model} model)"
    with tempfile.TemporaryDirectory() as tmp:
        servers = start_servers(model, Path(tmp))
        try:
            urls = {name: server.url + "/v1/systemone" for name, server in servers.items()}
            extend = bench_extend(urls, args.rounds, args.state_tokens, args.seed)
            agent = bench_agent(urls, args.steps, args.agent_start_tokens, args.seed, args.agent_reps)
        finally:
            for server in servers.values():
                server.stop(120)
    result.update({"extend": extend, "agent": agent})
    save(result, args.output, "growing")
    print(
        f"extend: cached {extend['median_cached_s']:.3f} s, cold {extend['median_cold_s']:.3f} s, "
        f"{extend['speedup']}x ({extend['speedup_spread']['min']}-{extend['speedup_spread']['max']}); agent "
        f"({args.steps} steps, {args.agent_reps} runs): cached {agent['total_cached_s']} s, cold "
        f"{agent['total_cold_s']} s, {agent['speedup']}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
