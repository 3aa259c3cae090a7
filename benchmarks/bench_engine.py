"""The serving engine under bursts, through a real ``clef serve`` process with its default settings.

For each model (default: ``medium-1024x4``, hidden 1,024 / 4 layers, the engine's target model, and
``medium``, hidden 512 / 8 layers), one server is started and, ``--reps`` times (default 3, the order of the
passes alternating), three loads are sent with fresh states (no state-cache hits):

- ``sequential``: ``--requests`` (16) long requests (~``--long-tokens``, 1,100 input tokens) one after
  another: the idle latency of one long request and the sequential throughput;
- ``burst``: the same number of long requests at once: throughput against sequential, the mean latency
  over the burst's makespan (1.0 = everyone answered at the end; about 0.5 = answered one after another),
  and the spread of completion times;
- ``shorts``: a burst of long requests, and ``--shorts`` (8) short requests (~``--short-tokens``, 120) sent
  one by one during it, evenly over the burst's expected makespan: the short requests' latency against one
  long request's idle latency.

``--in-process 512 1024 ...`` adds the engine alone (no HTTP, no client threads) at those step budgets:
half the requests each alone against the other half at once, paired per repetition, wall and CPU time.

With ``--baseline-src DIR`` (a ``src`` directory of another checkout: ``git worktree add /tmp/base
<commit>``) the same loads also run against that code's server in the same run, for a side-by-side ratio.
Every response's engine timing headers (``x-queue-time``, ``x-inference-time``, ``X-Clef-Steps``) are kept
when the server sends them.

    python -m benchmarks.bench_engine --json benchmarks/results/engine-<date>.json
    python -m benchmarks.bench_engine --baseline-src /tmp/base/src --models medium-1024x4
    python -m benchmarks.bench_engine --quick          # smoke run on tiny (seconds)

Not a test: figures depend on the machine and its load (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from devtools.harness import ServerProcess, start_clef_server
from devtools.models import resolve_model
from devtools.results import add_run_arguments, save, start_report
from devtools.timing import spread

WORDS = ["charged", "twice", "refund", "order", "invoice", "march", "please", "today", "bank", "dispute"]
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is a refund asked for?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "tech": None}},
}
#: Input tokens of a request whose state is empty (prompt prefix, the two questions, the suffix), and
#: state tokens per word of `WORDS` (each word is one token after a space): measured with the encoder.
_FIXED_TOKENS, _TOKENS_PER_WORD = 0, 1.0


def calibrate_words() -> None:
    """Measure `_FIXED_TOKENS` and `_TOKENS_PER_WORD` with the package's encoder (no model needed)."""
    global _FIXED_TOKENS, _TOKENS_PER_WORD
    from clef_runtime.encoding.encoder import Encoder
    from clef_runtime.encoding.fast_bpe import tokenizer_for_encoding
    from clef_runtime.encoding.tokenizer import ClefTokenizer, default_tokenizer_path
    from clef_runtime.protocol.systemone import parse_request

    encoder = Encoder(tokenizer_for_encoding(ClefTokenizer.load(Path(default_tokenizer_path()).parent)))
    rng = random.Random(0)

    def tokens(words: int) -> int:
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        return encoder.encode(parse_request({"state": text, "questions": QUESTIONS})).input_tokens

    _FIXED_TOKENS = tokens(0)
    _TOKENS_PER_WORD = (tokens(1000) - _FIXED_TOKENS) / 1000


def body(rng: random.Random, tokens: int, tag: str) -> dict[str, Any]:
    """A request of about ``tokens`` input tokens, its state unique (``tag`` and random words)."""
    words = max(1, round((tokens - _FIXED_TOKENS - 4) / _TOKENS_PER_WORD))
    return {"state": f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(words)), "questions": QUESTIONS}


def _post(client: httpx.Client, payload: dict[str, Any], origin: float) -> dict[str, Any]:
    sent = time.perf_counter()
    response = client.post("/v1/systemone", json=payload)
    done = time.perf_counter()
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
    headers = response.headers
    return {
        "sent_s": round(sent - origin, 4),
        "done_s": round(done - origin, 4),
        "latency_s": round(done - sent, 4),
        "input_tokens": response.json()["usage"]["input_tokens"],
        "queue_ms": _number(headers.get("x-queue-time")),
        "inference_ms": _number(headers.get("x-inference-time")),
        "steps": _number(headers.get("x-clef-steps")),
    }


def _number(text: str | None) -> float | None:
    return None if text is None else float(text)


def sequential(url: str, bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every body one after another on one connection."""
    with httpx.Client(base_url=url, timeout=900) as client:
        origin = time.perf_counter()
        answers = [_post(client, payload, origin) for payload in bodies]
        seconds = time.perf_counter() - origin
    return {"seconds": seconds, "requests": answers}


def burst(
    url: str, bodies: Sequence[dict[str, Any]], shorts: Sequence[dict[str, Any]] = (), spacing_s: float = 0.0
) -> dict[str, Any]:
    """Every body at once (one connection each); ``shorts`` then sent one by one, ``spacing_s`` apart,
    starting ``spacing_s`` after the burst, while it runs."""
    clients = [httpx.Client(base_url=url, timeout=900) for _ in range(len(bodies) + len(shorts))]
    results: list[dict[str, Any] | None] = [None] * (len(bodies) + len(shorts))
    barrier = threading.Barrier(len(bodies) + 1)
    origin = 0.0

    def long(index: int) -> None:
        barrier.wait()
        results[index] = _post(clients[index], bodies[index], origin)

    try:
        with ThreadPoolExecutor(len(bodies) + len(shorts)) as pool:
            futures = [pool.submit(long, i) for i in range(len(bodies))]
            origin = time.perf_counter()
            barrier.wait()
            for n, payload in enumerate(shorts):
                time.sleep(max(0.0, origin + spacing_s * (n + 1) - time.perf_counter()))
                index = len(bodies) + n
                futures.append(
                    pool.submit(
                        lambda i=index, p=payload: results.__setitem__(i, _post(clients[i], p, origin))
                    )
                )
            for future in futures:
                future.result()
    finally:
        for client in clients:
            client.close()
    longs = [r for r in results[: len(bodies)] if r is not None]
    makespan = max(r["done_s"] for r in longs)
    return {
        "makespan_s": makespan,
        "requests": longs,
        "shorts": [r for r in results[len(bodies) :] if r is not None],
    }


def passes(url: str, args: argparse.Namespace, rng: random.Random, rep: int) -> dict[str, Any]:
    """One repetition: sequential, burst, shorts-under-a-burst (alternating order by repetition)."""
    out: dict[str, Any] = {}
    order = ("sequential", "burst", "shorts") if rep % 2 == 0 else ("burst", "sequential", "shorts")
    for mode in order:
        longs = [
            body(rng, args.long_tokens, f"{mode}-{rep}-{i}-{rng.random()}") for i in range(args.requests)
        ]
        if mode == "sequential":
            out[mode] = sequential(url, longs)
        elif mode == "burst":
            out[mode] = burst(url, longs)
        else:
            expected = out.get("burst", {}).get("makespan_s") or out["sequential"]["seconds"]
            shorts = [
                body(rng, args.short_tokens, f"short-{rep}-{i}-{rng.random()}") for i in range(args.shorts)
            ]
            out[mode] = burst(url, longs, shorts, spacing_s=expected / (args.shorts + 1))
    seq, bur, sho = out["sequential"], out["burst"], out["shorts"]
    idle = statistics.median(r["latency_s"] for r in seq["requests"])
    latencies = [r["latency_s"] for r in bur["requests"]]
    out["figures"] = {
        "idle_long_latency_s": idle,
        "throughput_vs_sequential": seq["seconds"] / bur["makespan_s"],
        "mean_latency_over_makespan": statistics.mean(latencies) / bur["makespan_s"],
        "first_answer_over_makespan": min(r["done_s"] for r in bur["requests"]) / bur["makespan_s"],
        "burst_latency_over_idle": statistics.mean(latencies) / idle,
        "short_median_latency_s": statistics.median(r["latency_s"] for r in sho["shorts"]),
        "short_median_over_idle_long": statistics.median(r["latency_s"] for r in sho["shorts"]) / idle,
        "short_max_over_idle_long": max(r["latency_s"] for r in sho["shorts"]) / idle,
    }
    return out


def measure(
    model: str,
    args: argparse.Namespace,
    label: str,
    src: Path | None,
    log_dir: Path,
    step_tokens: int | None = None,
) -> dict[str, Any]:
    """Start a server of ``model`` (this checkout, or the code in ``src``; ``step_tokens``: its
    ``--max-step-tokens``, None: the default) and run every repetition."""
    env = {"PYTHONPATH": str(src)} if src is not None else None
    settings: dict[str, Any] = {"log_level": "warning"}
    if step_tokens is not None:
        settings["max_step_tokens"] = step_tokens
    server: ServerProcess = start_clef_server(
        resolve_model(model), log_path=log_dir / f"{label}-{model}.log", env=env, **settings
    )
    rng = random.Random(f"{label}-{model}")
    try:
        reps = [passes(server.url, args, rng, rep) for rep in range(args.reps)]
    finally:
        server.stop()
    figures = {name: spread(rep["figures"][name] for rep in reps) for name in reps[0]["figures"]}
    return {"server": label, "model": model, "step_tokens": step_tokens, "figures": figures, "reps": reps}


def in_process(model: str, budgets: Sequence[int], args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone (no HTTP, no client threads): per step budget and repetition, ``requests / 2``
    long requests each alone (one `EngineLoop` each, the way sequential requests run) against as many at
    once in one loop, side by side; wall and CPU seconds. The state cache is off."""
    from clef_runtime.engine.clef import Clef
    from clef_runtime.engine.loop import EngineLoop
    from clef_runtime.engine.policy import StepSettings

    clef = Clef.load(resolve_model(model), cache_mb=0)
    clef.prepare_compute_thread()
    clef.warmup()
    rng = random.Random(f"in-process-{model}")
    half = max(1, args.requests // 2)
    out: dict[str, Any] = {"model": model, "requests_each_way": half, "budgets": {}}
    for budget in budgets:
        runs = []
        for rep in range(args.reps):
            items = [
                clef.prepare(body(rng, args.long_tokens, f"{budget}-{rep}-{i}-{rng.random()}"))
                for i in range(2 * half)
            ]
            settings = StepSettings(max_step_tokens=budget)
            wall, cpu = time.perf_counter(), time.process_time()
            for item in items[:half]:
                loop = EngineLoop(clef.runner(), settings)
                future = loop.submit(item)
                loop.run_until_idle()
                future.result()
            sequential = (time.perf_counter() - wall, time.process_time() - cpu)
            wall, cpu = time.perf_counter(), time.process_time()
            loop = EngineLoop(clef.runner(), settings)
            futures = [loop.submit(item) for item in items[half:]]
            loop.run_until_idle()
            steps = max(future.result().timings.steps for future in futures)
            burst = (time.perf_counter() - wall, time.process_time() - cpu)
            runs.append(
                {
                    "sequential_s": sequential[0],
                    "burst_s": burst[0],
                    "sequential_cpu_s": sequential[1],
                    "burst_cpu_s": burst[1],
                    "burst_steps_of_the_last": steps,
                }
            )
        out["budgets"][str(budget)] = {
            "runs": runs,
            "throughput_vs_sequential": spread(r["sequential_s"] / r["burst_s"] for r in runs),
            "cpu_throughput_vs_sequential": spread(r["sequential_cpu_s"] / r["burst_cpu_s"] for r in runs),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, quick="tiny, 1 rep, 4 long + 2 short requests of ~300 / ~120 tokens")
    parser.add_argument("--models", nargs="+", default=["medium-1024x4", "medium"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=1100)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=120)
    parser.add_argument("--baseline-src", type=Path, default=None, help="another checkout's src directory")
    parser.add_argument(
        "--in-process",
        type=int,
        nargs="*",
        default=None,
        help="also (or, with --no-server, only) the engine alone at these step budgets, on the first model",
    )
    parser.add_argument("--no-server", action="store_true", help="skip the server runs")
    parser.add_argument(
        "--step-tokens",
        type=int,
        nargs="*",
        default=[],
        help="also run servers with these --max-step-tokens (the default server always runs)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.reps, args.requests, args.shorts, args.long_tokens = ["tiny"], 1, 4, 2, 300
    calibrate_words()
    report = start_report("bench_engine", __file__, argv, quick=args.quick)
    report["settings"] = {k: v for k, v in vars(args).items() if k not in ("json", "baseline_src")}
    report["baseline_src"] = str(args.baseline_src) if args.baseline_src else None
    runs = []
    if args.in_process:
        from clef_runtime.model.kernels import configure_cpu_threads

        configure_cpu_threads()
        report["in_process"] = in_process(args.models[0], args.in_process, args)
    with tempfile.TemporaryDirectory() as logs:
        for model in [] if args.no_server else args.models:
            runs.append(measure(model, args, "this", None, Path(logs)))
            for tokens in args.step_tokens:
                runs.append(measure(model, args, f"step {tokens}", None, Path(logs), tokens))
            if args.baseline_src is not None:
                runs.append(measure(model, args, "baseline", args.baseline_src.resolve(), Path(logs)))
    report["runs"] = runs
    compact_requests(report)
    path = save(report, args.json, "engine")
    if runs:
        print(render(report))
    for budget, figures in report.get("in_process", {}).get("budgets", {}).items():
        ratio = figures["throughput_vs_sequential"]
        low, high = ratio["min"], ratio["max"]
        print(f"in-process, step {budget}: burst / sequential {ratio['median']:.2f} ({low:.2f}-{high:.2f})")
    print(f"results: {path}")
    return 0


#: The fields of every request row in a results file (rows instead of dicts keep the file small).
REQUEST_FIELDS = ("sent_s", "done_s", "latency_s", "input_tokens", "queue_ms", "inference_ms", "steps")


def compact_requests(report: dict[str, Any]) -> None:
    """Store every request of every pass as a row of `REQUEST_FIELDS` (in place)."""
    report["request_fields"] = list(REQUEST_FIELDS)
    for run in report["runs"]:
        for rep in run["reps"]:
            for mode in ("sequential", "burst", "shorts"):
                for key in ("requests", "shorts"):
                    if key in rep[mode]:
                        rep[mode][key] = [[request[f] for f in REQUEST_FIELDS] for request in rep[mode][key]]


def render(report: dict[str, Any]) -> str:
    """A markdown table of the headline figures (median, min-max over the repetitions)."""
    names = [
        ("throughput_vs_sequential", "burst / sequential throughput"),
        ("mean_latency_over_makespan", "mean latency / makespan"),
        ("burst_latency_over_idle", "burst mean latency / idle"),
        ("short_median_over_idle_long", "short median latency / one long idle"),
        ("idle_long_latency_s", "one long request idle (s)"),
    ]
    lines = ["| model | server | " + " | ".join(label for _, label in names) + " |"]
    lines.append("|---|---|" + "---|" * len(names))
    for run in report["runs"]:
        cells = []
        for name, _ in names:
            f = run["figures"][name]
            cells.append(f"{f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f})")
        lines.append(f"| {run['model']} | {run['server']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
