"""Batching and the warm path through a real ``clef serve`` process, on the hidden-512 / 8-layer medium model.

Two servers run one after the other on the same random checkpoint (built by ``server_harness.make_medium``):
``capped`` (the default: `Backbone.extend` splits a batch into calls of at most 4,096 rows x tokens) and
``uncapped`` (the previous behaviour: one call per batch, cut only at snapshots), started with the
module default patched before load. Each server gets, with fresh states every pass (so no state-cache
hits):

- ``sequential``: 16 requests one after another (client concurrency 1);
- ``concurrent``: 16 requests at once (16 client threads; the server's batcher batches them);

for states of 90-110% of 100 and of 1,000 words (one question). Then, on the capped server only, the warm
path: a 2,000-word state asked cold, then with new 3-question schemas (same state, warm), timed by the
client and by the server's ``x_latency_ms``; and the same warm call in-process (``Clef.decide``) in this
process, after the server is stopped.

    python benchmarks/bench_batching.py --json benchmarks/results/batching.json

Not a test: figures depend on the machine and its load (recorded in the JSON).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_harness import WORDS, free_port, make_medium, start_server, stop_server

REPO = Path(__file__).resolve().parents[1]

# Starts `clef serve` with Backbone's default call cap replaced by argv[1] ("none" or a number).
LAUNCHER = (
    "import sys\n"
    "import clef_runtime.model.backbone as backbone\n"
    "cap = sys.argv[1]\n"
    "backbone.DEFAULT_MAX_CALL_TOKENS = None if cap == 'none' else int(cap)\n"
    "from clef_runtime.cli import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def body(rng: random.Random, words: int, tag: str, questions: int = 1) -> dict[str, Any]:
    """A request with a state of ``words`` random words and ``questions`` questions tagged ``tag``."""
    kinds = [
        {"type": "noul", "instructions": f"Is a refund asked for? {tag}"},
        {"type": "choice", "instructions": f"Which team? {tag}", "criteria": {"billing": None, "tech": None}},
        {"type": "score", "instructions": f"How urgent? {tag}", "criteria": ["later", "soon", "now"]},
    ]
    return {
        "model": "clef",
        "state": " ".join(rng.choice(WORDS) for _ in range(words)),
        "questions": {f"q{n}": kinds[n % 3] for n in range(questions)},
    }


def send(url: str, bodies: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """Post every body with ``concurrency`` client threads; returns wall seconds and per-request figures."""
    clients = [httpx.Client(base_url=url, timeout=900) for _ in range(concurrency)]
    latencies: list[float] = []
    server_ms: list[float] = []
    tokens: list[int] = []

    def worker(index: int) -> None:
        for item in bodies[index::concurrency]:
            started = time.perf_counter()
            response = clients[index].post("/v1/systemone", json=item)
            latencies.append(time.perf_counter() - started)
            response.raise_for_status()
            answer = response.json()
            server_ms.append(answer.get("x_latency_ms", float("nan")))
            tokens.append(answer["usage"]["input_tokens"])

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    seconds = time.perf_counter() - started
    for client in clients:
        client.close()
    return {"seconds": seconds, "latencies_s": latencies, "server_ms": server_ms, "tokens": tokens}


def batching_passes(url: str, rng: random.Random, words: int, count: int, reps: int) -> dict[str, Any]:
    """``reps`` alternating sequential / concurrent passes of ``count`` fresh requests each."""
    out: dict[str, list[dict[str, Any]]] = {"sequential": [], "concurrent": []}
    for rep in range(reps):
        order = ("sequential", "concurrent") if rep % 2 == 0 else ("concurrent", "sequential")
        for mode in order:
            bodies = [
                body(rng, rng.randint(words * 9 // 10, words * 11 // 10), f"{mode}{rep}-{i}-{rng.random()}")
                for i in range(count)
            ]
            out[mode].append(send(url, bodies, 1 if mode == "sequential" else count))
    fastest = {mode: min(run["seconds"] for run in runs) for mode, runs in out.items()}
    total = {mode: sum(run["seconds"] for run in runs) for mode, runs in out.items()}
    return {
        "words": words,
        "requests": count,
        "mean_input_tokens": statistics.mean(t for run in out["sequential"] for t in run["tokens"]),
        "runs": out,
        "sequential_s_fastest": fastest["sequential"],
        "concurrent_s_fastest": fastest["concurrent"],
        "throughput_ratio_fastest": fastest["sequential"] / fastest["concurrent"],
        "throughput_ratio_all": total["sequential"] / total["concurrent"],
    }


def warm_path_server(url: str, rng: random.Random, state_words: int, reps: int) -> dict[str, Any]:
    """Cold then warm (same state, new 3-question schema) requests; client and server milliseconds."""
    cold, warm = [], []
    with httpx.Client(base_url=url, timeout=900) as client:
        for rep in range(reps):
            first = body(rng, state_words, f"cold{rep}", questions=3)
            started = time.perf_counter()
            response = client.post("/v1/systemone", json=first)
            response.raise_for_status()
            cold.append({"client_ms": 1000 * (time.perf_counter() - started), **_server_fields(response)})
            for turn in range(3):
                again = dict(first, questions=body(rng, 1, f"warm{rep}-{turn}", questions=3)["questions"])
                started = time.perf_counter()
                response = client.post("/v1/systemone", json=again)
                response.raise_for_status()
                warm.append({"client_ms": 1000 * (time.perf_counter() - started), **_server_fields(response)})
    return {"cold": cold, "warm": warm}


def _server_fields(response: httpx.Response) -> dict[str, Any]:
    answer = response.json()
    return {
        "server_ms": answer.get("x_latency_ms"),
        "state_cache": response.headers.get("x-clef-state-cache"),
        "input_tokens": answer["usage"]["input_tokens"],
    }


def warm_path_in_process(model: Path, rng: random.Random, state_words: int, reps: int) -> dict[str, Any]:
    """The same cold / warm sequence with ``Clef.decide`` in this process (ms)."""
    from clef_runtime.engine.clef import Clef

    clef = Clef.load(str(model))
    clef.warmup()
    cold, warm = [], []
    for rep in range(reps):
        first = body(rng, state_words, f"cold{rep}", questions=3)
        started = time.perf_counter()
        clef.decide(first)
        cold.append(1000 * (time.perf_counter() - started))
        for turn in range(3):
            again = dict(first, questions=body(rng, 1, f"warm{rep}-{turn}", questions=3)["questions"])
            started = time.perf_counter()
            clef.decide(again)
            warm.append(1000 * (time.perf_counter() - started))
    return {"cold_ms": cold, "warm_ms": warm}


def serve(model: Path, cap: str, tmp: Path) -> tuple[Any, str]:
    """Start a server with the given call cap; returns (process, base url)."""
    port = free_port()
    command = [sys.executable, "-c", LAUNCHER, cap, "serve", "--model", str(model), "--port", str(port)]
    command += ["--log-level", "warning"]
    process = start_server(command, port, tmp / f"server-{cap}.log")
    return process, f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "batching.json")
    parser.add_argument("--model-dir", type=Path, help="reuse (or build here) the medium checkpoint")
    parser.add_argument("--reps", type=int, default=1, help="sequential/concurrent pass pairs per size")
    parser.add_argument("--warm-reps", type=int, default=2)
    parser.add_argument("--words", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--skip-uncapped", action="store_true")
    args = parser.parse_args(argv)
    # Before torch's first parallel operation (as the CLI does): flush-to-zero must reach the OpenMP workers,
    # or the in-process side computes the DeltaNet decays with denormals.
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()

    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="clef-batching-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model_dir or tmp / "medium"
        if not (model / "config.json").exists():
            print("building the medium model ...", flush=True)
            make_medium(model)
        result: dict[str, Any] = {"servers": {}}
        for cap in ["4096"] + ([] if args.skip_uncapped else ["none"]):
            print(f"== server with call cap {cap}", flush=True)
            process, url = serve(model, cap, tmp)
            try:
                rng = random.Random(f"batching-{cap}")
                send(url, [body(rng, 50, "warm-up")], 1)
                entry: dict[str, Any] = {}
                for words in args.words:
                    entry[str(words)] = batching_passes(url, random.Random(words), words, 16, args.reps)
                    print(
                        f"   {words} words: x{entry[str(words)]['throughput_ratio_fastest']:.2f}", flush=True
                    )
                if cap != "none":
                    entry["warm_path"] = warm_path_server(url, random.Random("warm"), 2000, args.warm_reps)
            finally:
                stop_server(process)
            result["servers"][cap] = entry
        print("== in-process warm path", flush=True)
        result["in_process_warm_path"] = warm_path_in_process(
            model, random.Random("warm"), 2000, args.warm_reps
        )
    result["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_before_after": [load_before, os.getloadavg()],
        "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "seconds": time.time() - started,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary(result), indent=1))
    print(render(result))
    return 0


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a result."""
    out: dict[str, Any] = {}
    for cap, entry in result["servers"].items():
        for words, value in entry.items():
            if words == "warm_path":
                server_warm = [w["server_ms"] for w in value["warm"]]
                client_warm = [w["client_ms"] for w in value["warm"]]
                client_cold = [c["client_ms"] for c in value["cold"]]
                out[f"{cap}/warm"] = {
                    "server_warm_ms_median": statistics.median(server_warm),
                    "client_warm_ms_median": statistics.median(client_warm),
                    "client_cold_ms_median": statistics.median(client_cold),
                    "cold_over_warm_client_fastest": min(client_cold) / min(client_warm),
                }
            else:
                out[f"{cap}/{words}"] = {
                    k: value[k]
                    for k in ("throughput_ratio_fastest", "throughput_ratio_all", "mean_input_tokens")
                }
    local = result.get("in_process_warm_path")
    if local:
        out["in_process"] = {
            "warm_ms_median": statistics.median(local["warm_ms"]),
            "cold_ms_median": statistics.median(local["cold_ms"]),
            "cold_over_warm_fastest": min(local["cold_ms"]) / min(local["warm_ms"]),
        }
    return out


def render(result: dict[str, Any]) -> str:
    """A markdown table of a result (for BENCHMARKS.md)."""
    lines = [
        "| server | states | mean input tokens | sequential s (fastest) | concurrent s (fastest) "
        "| throughput ratio: fastest / all |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for cap, entry in result["servers"].items():
        name = "capped (4,096 rows x tokens per call)" if cap != "none" else "uncapped (before)"
        for words, value in entry.items():
            if words == "warm_path":
                continue
            lines.append(
                f"| {name} | {words} words | {value['mean_input_tokens']:.0f} "
                f"| {value['sequential_s_fastest']:.2f} | {value['concurrent_s_fastest']:.2f} "
                f"| **{value['throughput_ratio_fastest']:.2f}x** / {value['throughput_ratio_all']:.2f}x |"
            )
    heads = summary(result)
    warm = next((v for k, v in heads.items() if k.endswith("/warm")), None)
    local = heads.get("in_process")
    if warm and local:
        lines += [
            "",
            "| warm path (2,000-word state, new 3-question schema) | median ms | cold / warm (fastest) |",
            "|---|---:|---:|",
            f"| in-process `Clef.decide` | {local['warm_ms_median']:.0f} "
            f"| {local['cold_over_warm_fastest']:.1f}x |",
            f"| server, `x_latency_ms` | {warm['server_warm_ms_median']:.0f} | - |",
            f"| server, client round trip | {warm['client_warm_ms_median']:.0f} "
            f"| {warm['cold_over_warm_client_fastest']:.1f}x |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
