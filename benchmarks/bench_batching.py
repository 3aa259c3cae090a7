"""Batching and the warm path through a real ``clef serve`` process, on the hidden-512 / 8-layer medium model.

Two servers run one after the other on the same random checkpoint (the ``medium`` benchmark model of
`devtools.models`):
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

Every figure is repeated (``--reps`` sequential / concurrent pass pairs, default 3; ``--warm-reps`` cold
states with 3 warm schemas each, default 3) and reported with its spread over the repetitions.

    python -m benchmarks.bench_batching --skip-uncapped --json benchmarks/results/batching-2.json
    python -m benchmarks.bench_batching --quick --json /tmp/batching.json     # smoke run on tiny (seconds)

Not a test: figures depend on the machine and its load (recorded in the JSON).
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
from devtools.flags import engine_options
from devtools.harness import Load, ServerProcess, post_all, start_clef_server
from devtools.models import resolve_model
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import spread

WORDS = ["charged", "twice", "refund", "order", "invoice", "march", "please", "today", "bank", "dispute"]

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


def batching_passes(url: str, rng: random.Random, words: int, count: int, reps: int) -> dict[str, Any]:
    """``reps`` alternating sequential / concurrent passes of ``count`` fresh requests each."""
    out: dict[str, list[Load]] = {"sequential": [], "concurrent": []}
    for rep in range(reps):
        order = ("sequential", "concurrent") if rep % 2 == 0 else ("concurrent", "sequential")
        for mode in order:
            bodies = [
                body(rng, rng.randint(words * 9 // 10, words * 11 // 10), f"{mode}{rep}-{i}-{rng.random()}")
                for i in range(count)
            ]
            load = post_all(url, bodies, 1 if mode == "sequential" else count)
            if load.errors:
                raise RuntimeError(f"{load.errors} of {count} requests failed")
            out[mode].append(load)
    fastest = {mode: min(run.seconds for run in runs) for mode, runs in out.items()}
    total = {mode: sum(run.seconds for run in runs) for mode, runs in out.items()}
    pairs = zip(out["sequential"], out["concurrent"], strict=True)
    return {
        "words": words,
        "requests": count,
        "mean_input_tokens": statistics.mean(t for run in out["sequential"] for t in run.input_tokens),
        "runs": {mode: [run.as_dict() for run in runs] for mode, runs in out.items()},
        "sequential_s_fastest": fastest["sequential"],
        "concurrent_s_fastest": fastest["concurrent"],
        "throughput_ratio_fastest": fastest["sequential"] / fastest["concurrent"],
        "throughput_ratio_all": total["sequential"] / total["concurrent"],
        # sequential / concurrent seconds of each pass pair (measured back to back).
        "throughput_ratio_spread": spread(seq.seconds / conc.seconds for seq, conc in pairs),
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


def warm_path_in_process(model: str, rng: random.Random, state_words: int, reps: int) -> dict[str, Any]:
    """The same cold / warm sequence with ``Clef.decide`` in this process (ms)."""
    from clef_runtime.engine.clef import Clef

    clef = Clef.load(model, engine_options())
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


def serve(model: str, cap: str, log_path: Path) -> ServerProcess:
    """Start a server with the given call cap (no batch jobs: not measured here)."""
    launcher = [sys.executable, "-c", LAUNCHER, cap]
    return start_clef_server(model, launcher=launcher, log_path=log_path, log_level="warning", jobs=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_run_arguments(parser, quick="tiny, 1 rep, short states", model="medium")
    parser.add_argument("--reps", type=int, default=3, help="sequential/concurrent pass pairs per size")
    parser.add_argument("--warm-reps", type=int, default=3, help="cold states, each with 3 warm schemas")
    parser.add_argument("--words", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--state-words", type=int, default=2000, help="the warm path's state (default 2000)")
    parser.add_argument("--skip-uncapped", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.reps, args.warm_reps, args.words, args.state_words = "tiny", 1, 1, [20], 200
        args.skip_uncapped = True
    # Before torch's first parallel operation (as the CLI does): flush-to-zero must reach the OpenMP workers,
    # or the in-process side computes the DeltaNet decays with denormals.
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    model = resolve_model(args.model)
    result = start_report("bench_batching", __file__, argv, quick=args.quick)
    result.update({"model": args.model, "servers": {}})
    with tempfile.TemporaryDirectory(prefix="clef-batching-") as tmp:
        for cap in ["4096"] + ([] if args.skip_uncapped else ["none"]):
            print(f"== server with call cap {cap}", flush=True)
            server = serve(model, cap, Path(tmp) / f"server-{cap}.log")
            try:
                rng = random.Random(f"batching-{cap}")
                post_all(server.url, [body(rng, 50, "warm-up")], 1)
                entry: dict[str, Any] = {}
                for words in args.words:
                    entry[str(words)] = batching_passes(
                        server.url, random.Random(words), words, 16, args.reps
                    )
                    ratio = entry[str(words)]["throughput_ratio_spread"]
                    print(
                        f"   {words} words: x{ratio['median']:.2f} ({ratio['min']}-{ratio['max']})",
                        flush=True,
                    )
                if cap != "none":
                    rng = random.Random("warm")
                    entry["warm_path"] = warm_path_server(server.url, rng, args.state_words, args.warm_reps)
            finally:
                server.stop(120)
            result["servers"][cap] = entry
    print("== in-process warm path", flush=True)
    result["in_process_warm_path"] = warm_path_in_process(
        model, random.Random("warm"), args.state_words, args.warm_reps
    )
    result["summary"] = summary(result)
    save(result, args.json, "batching")
    print(json.dumps(result["summary"], indent=1))
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
                    "server_warm_ms_spread": spread(server_warm, 1),
                    "client_warm_ms_spread": spread(client_warm, 1),
                    "client_cold_ms_spread": spread(client_cold, 1),
                    "cold_over_warm_client_spread": _cold_over_warm(client_cold, client_warm),
                }
            else:
                out[f"{cap}/{words}"] = {
                    k: value[k]
                    for k in (
                        "throughput_ratio_fastest",
                        "throughput_ratio_all",
                        "throughput_ratio_spread",
                        "mean_input_tokens",
                    )
                }
    local = result.get("in_process_warm_path")
    if local:
        out["in_process"] = {
            "warm_ms_median": statistics.median(local["warm_ms"]),
            "cold_ms_median": statistics.median(local["cold_ms"]),
            "cold_over_warm_fastest": min(local["cold_ms"]) / min(local["warm_ms"]),
            "warm_ms_spread": spread(local["warm_ms"], 1),
            "cold_over_warm_spread": _cold_over_warm(local["cold_ms"], local["warm_ms"]),
        }
    return out


def _cold_over_warm(cold: Sequence[float], warm: Sequence[float]) -> dict[str, Any]:
    """Each cold request over each of the 3 warm requests on its state."""
    return spread((c / w for index, c in enumerate(cold) for w in warm[3 * index : 3 * index + 3]), 2)


def _range(figures: dict[str, Any], digits: int = 2) -> str:
    return f"{figures['median']:.{digits}f} ({figures['min']:.{digits}f}-{figures['max']:.{digits}f})"


def render(result: dict[str, Any]) -> str:
    """Markdown tables of a result (for BENCHMARKS.md): medians with the range over the repetitions."""
    lines = [
        "| server | states | mean input tokens | sequential s (fastest) | concurrent s (fastest) "
        "| throughput ratio: fastest / all | per pass: median (min-max), passes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cap, entry in result["servers"].items():
        name = "capped (4,096 rows x tokens per call)" if cap != "none" else "uncapped"
        for words, value in entry.items():
            if words == "warm_path":
                continue
            ratio = value["throughput_ratio_spread"]
            lines.append(
                f"| {name} | {words} words | {value['mean_input_tokens']:.0f} "
                f"| {value['sequential_s_fastest']:.2f} | {value['concurrent_s_fastest']:.2f} "
                f"| **{value['throughput_ratio_fastest']:.2f}x** / {value['throughput_ratio_all']:.2f}x "
                f"| {_range(ratio)}, {ratio['n']} |"
            )
    heads = result.get("summary") or summary(result)
    warm = next((v for k, v in heads.items() if k.endswith("/warm")), None)
    local = heads.get("in_process")
    if warm and local:
        lines += [
            "",
            "| warm path (same state, new 3-question schema) | warm ms: median (min-max), runs "
            "| cold / warm (fastest) | cold / warm per pair: median (min-max) |",
            "|---|---:|---:|---:|",
            f"| in-process `Clef.decide` | {_range(local['warm_ms_spread'], 0)}, "
            f"{local['warm_ms_spread']['n']} | {local['cold_over_warm_fastest']:.1f}x "
            f"| {_range(local['cold_over_warm_spread'], 1)} |",
            f"| server, `x_latency_ms` | {_range(warm['server_warm_ms_spread'], 0)}, "
            f"{warm['server_warm_ms_spread']['n']} | - | - |",
            f"| server, client round trip | {_range(warm['client_warm_ms_spread'], 0)}, "
            f"{warm['client_warm_ms_spread']['n']} | {warm['cold_over_warm_client_fastest']:.1f}x "
            f"| {_range(warm['cold_over_warm_client_spread'], 1)} |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
