"""One prepared check for a machine with one NVIDIA GPU (under 8 minutes): is the CUDA path right and fast?

For the tiny and the hidden-1,024 benchmark model (``medium-1024``; ``--quick``: tiny only, fewer requests):

- parity: ``--requests`` generated requests on the device (bf16 backbone, fp32 head: the CUDA defaults)
  against CPU fp32: max and mean |dp| over every option probability, top-1 agreement;
- the startup warm-up's time (every batch shape the server can form: Triton autotuning happens there)
  and the first request after it;
- throughput at ~512-token requests: concurrency 1 (one request at a time) and 16 (one batched
  ``decide_encoded`` of 16, in engine steps as the server runs them), tokens/s of the fastest of ``--rounds``
  (every round kept with its spread), state cache off;
- peak device memory (``torch.cuda.max_memory_allocated``);
- all of the above with the fused DeltaNet kernels on and off (``--no-fused-kernels``; on only means
  something where the ``cuda`` extra is installed: the report says which packages were found).

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out``, the JSON with the machine record (GPU name,
GEMM limits on the device). ``--device cpu --quick`` runs the same plumbing on CPU in seconds (the test
suite does that); numbers from it mean nothing for a GPU.

    pip install -e '.[cuda]'          # on the GPU machine, optional: the fused kernels
    python benchmarks/gpu_check.py --out gpu-results
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.lib.flags import engine_options
from benchmarks.lib.models import resolve_model
from benchmarks.lib.requests import STATE_WORDS, drift, generated_requests
from benchmarks.lib.results import save, start_report
from benchmarks.lib.timing import repeat


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def request_of_tokens(clef: Any, tokens: int, tag: int) -> dict[str, Any]:
    """A one-question request whose encoding is ``tokens`` long (give or take a few), found by growing the
    state word by word from an estimate."""
    rng = random.Random(tag)
    question = {"q": {"type": "choice", "criteria": {"yes": "it is", "no": "it is not", "maybe": None}}}
    words = [rng.choice(STATE_WORDS) for _ in range(tokens)]
    base = clef.encode({"state": "a", "questions": question}).input_tokens
    count = max(1, tokens - base)
    return {"state": " ".join(words[:count]), "questions": question}


def probabilities(clef: Any, requests: list[dict[str, Any]]) -> list[list[list[float]]]:
    out = []
    for request in requests:
        out += clef.probabilities_encoded([clef.prepare(request)])
    return out


def throughput(clef: Any, device: str, tokens: int, concurrency: int, rounds: int) -> dict[str, Any]:
    """Tokens/s at ``concurrency`` requests of ~``tokens`` tokens (batched into one call when > 1)."""
    items = [clef.prepare(request_of_tokens(clef, tokens, tag)) for tag in range(concurrency)]
    real = sum(item.record.input_tokens for item in items)
    sync(device)
    # Concurrency 1: one request; more: one batch, as the server's batcher makes.
    seconds = repeat(lambda: clef.decide_encoded(items), rounds, warmup=0, sync=lambda: sync(device))
    best = seconds.min
    return {
        "concurrency": concurrency,
        "tokens": real,
        "best_s": round(best, 4),
        "tokens_per_s": round(real / best, 1),
        "requests_per_s": round(concurrency / best, 2),
        "tokens_per_s_spread": seconds.map(lambda s: real / s).summary(1),
    }


def check_model(name: str, args: argparse.Namespace, requests: list[dict[str, Any]]) -> dict[str, Any]:
    from clef_runtime.engine.clef import Clef

    spec = resolve_model(name)
    reference_clef = Clef.load(spec, engine_options(device="cpu", weights="fp32", cache_mb=0))
    started = time.perf_counter()
    reference = probabilities(reference_clef, requests)
    result: dict[str, Any] = {"cpu_fp32_s": round(time.perf_counter() - started, 2)}
    del reference_clef
    gc.collect()
    for fused in (True, False):
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        clef = Clef.load(spec, engine_options(device=args.device, cache_mb=0, fused_kernels=fused))
        started = time.perf_counter()
        clef.warmup(max_rows=16)
        sync(args.device)
        warmup_s = time.perf_counter() - started
        started = time.perf_counter()
        clef.decide(requests[0])
        sync(args.device)
        first_s = time.perf_counter() - started
        got = probabilities(clef, requests)
        run: dict[str, Any] = {
            "backbone_dtype": str(clef.backbone.dtype).removeprefix("torch."),
            "weights": clef.backbone.weight_mode,
            "warmup_s": round(warmup_s, 2),
            "first_request_after_warmup_s": round(first_s, 3),
            "parity_vs_cpu_fp32": drift(reference, got),
            "throughput": [
                throughput(clef, args.device, args.tokens, concurrency, args.rounds)
                for concurrency in args.concurrency
            ],
        }
        if args.device.startswith("cuda"):
            run["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        result["fused_on" if fused else "fused_off"] = run
        print(json.dumps({name: {("fused_on" if fused else "fused_off"): run}}), file=sys.stderr, flush=True)
        del clef
        gc.collect()
    from clef_runtime.model.fused import set_fused_kernels

    set_fused_kernels(True)
    return result


def render_markdown(report: dict[str, Any]) -> str:
    low, high = report["args"]["concurrency"][0], report["args"]["concurrency"][-1]
    machine = report["machine"]
    limit = machine["gemm"]["limit"]
    lines = [
        f"# gpu_check on {machine['gpu'] or 'CPU (' + machine['cpu'] + ')'}",
        "",
        f"torch {machine['torch']['version']}, CUDA {machine['torch']['cuda']}, fused packages "
        f"{report['fused']['packages']}, {report['wall_s']} s in all. Throughput: requests of "
        f"~{report['args']['tokens']} tokens. GEMM limits on the device: {limit}.",
        "",
        "| model | fused | max abs dp | mean abs dp | top-1 | warm-up s | first s "
        f"| tok/s c={low} | tok/s c={high} | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, result in report["models"].items():
        for key in ("fused_on", "fused_off"):
            run = result[key]
            parity = run["parity_vs_cpu_fp32"]
            rates = {t["concurrency"]: t["tokens_per_s"] for t in run["throughput"]}
            cells = [
                model,
                key.removeprefix("fused_"),
                parity["max_abs_dp"],
                parity["mean_abs_dp"],
                parity["top1_agreement"],
                run["warmup_s"],
                run["first_request_after_warmup_s"],
                rates[low],
                rates[high],
                run.get("peak_memory_gib", "-"),
            ]
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and .md")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny only, few requests (plumbing check)")
    parser.add_argument("--requests", type=int, default=None, help="parity requests (default 64; quick 4)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per throughput request (512)")
    parser.add_argument("--rounds", type=int, default=None, help="throughput repetitions (3; quick 1)")
    args = parser.parse_args(argv)
    args.requests = args.requests or (4 if args.quick else 64)
    args.tokens = args.tokens or (128 if args.quick else 512)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.concurrency = [1, 4] if args.quick else [1, 16]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu for a plumbing run)")

    from clef_runtime.model.fused import fused_kernels_status
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    report = start_report("gpu_check", __file__, argv, quick=args.quick, device=args.device)
    report["fused"] = fused_kernels_status()
    report["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["models"] = {}
    requests = generated_requests(args.requests, seed=7)
    for name in ("tiny",) if args.quick else ("tiny", "medium-1024"):
        report["models"][name] = check_model(name, args, requests)
    save(report, args.out / "gpu_check.json", "gpu_check")
    (args.out / "gpu_check.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
