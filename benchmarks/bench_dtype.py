"""bf16 against fp32 compute: speed through the server, drift through ``clef compare``, and the 9B projection
through ``Clef`` at the release's width, with the machine's GEMM limits measured in the same run.

Not a test. Three phases (``--phases``, default all):

- ``server``: two ``clef serve`` processes of ``--server-model`` (default ``medium-1024``, the hidden-1,024
  random release), one with the default ``--dtype auto`` and one with ``--dtype fp32``, both without a state
  cache. ``--reps`` rounds (order alternating); each round sends the same ``--requests`` fresh ~1k-token
  requests one after another to each server. Per round: tokens/s of each, their ratio, and the largest
  |dp| between the two servers' answers to the same requests (answers are rounded to 4 decimals).
- ``drift``: ``clef compare --a model=M,dtype=fp32 --b model=M,dtype=bf16`` (the real command) on
  generated cases: text states of 60 to 1,500 tokens with a noul, a 4-way choice and a 5-level score
  question each, and (``--drift-images``) cases with two images; per model max / mean |dp| and top-1 flips,
  among them the flips of *decisive* questions (fp32 top-1 margin >= ``--decisive`` ).
- ``realwidth``: the ``wide`` checkpoint (4 layers of the 9B's geometry, 3 Gated DeltaNet + 1 attention,
  full vocabulary and head) loaded through ``Clef.load`` in each mode (``fp32``; ``bf16``; ``int8`` of the
  ``late`` layers and of ``all``, fp32 compute), ``--reps`` fresh ~1k-token requests each after a warm-up,
  and the 9B projected from the backbone's share (32 layers = 8 such blocks; ``int8 late`` = 12 layers of
  fp32 + 20 of int8, from the per-layer times of the fp32 and int8-all runs), beside the GEMM limits of the
  block's own Linear shapes at that length, measured in the same process, and each mode's final hidden rows
  against fp32's on one fixed request (relative L2 per row: what the head reads).

    python -m benchmarks.bench_dtype --json benchmarks/results/dtype-<date>.json
    python -m benchmarks.bench_dtype --phases realwidth --profile     # where each mode's time goes
    python -m benchmarks.bench_dtype --quick                           # smoke run on tiny (seconds)
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from devtools.gemm import GemmShape, gemm_limit, measure_gemm
from devtools.harness import start_clef_server
from devtools.models import resolve_model
from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import spread

PHASES = ("server", "drift", "realwidth")
_TEXT = (
    "the parcel arrived broken and the customer asks for a refund of the order placed in march "
    "while the invoice shows a second charge on the card the bank has not reversed yet so please "
    "escalate this dispute to billing before friday"
)
WORDS = tuple(_TEXT.split())
QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {
        "type": "choice",
        "criteria": {"billing": "billing", "shipping": "shipping", "tech": "technical", "other": None},
    },
    "urgency": {"type": "score", "criteria": ["none", "low", "mid", "high", "critical"]},
}
NINE_B_LAYERS = 32
BLOCK_LAYERS = 4
LATE_INT8_LAYERS = 20  # layers 12-31 of 32: `--int8-layers late`
REALWIDTH_MODES: dict[str, dict[str, Any]] = {
    "fp32": {"dtype": "fp32", "weights": "fp32"},
    "bf16": {"dtype": "bf16"},
    "int8-late": {"dtype": "fp32", "weights": "int8", "int8_layers": "late"},
    "int8-all": {"dtype": "fp32", "weights": "int8", "int8_layers": "all"},
}


def state_text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def request(words: int, rng: random.Random, **extra: Any) -> dict[str, Any]:
    """A System One body with a fresh ~``words``-token state (every state differs: no cache can help)."""
    return {
        "state": f"ticket {rng.randrange(10**9)}: " + state_text(words, rng),
        "questions": QUESTIONS,
        **extra,
    }


def flat_probabilities(answers: dict[str, Any]) -> dict[str, float]:
    flat = {}
    for name, answer in answers.items():
        probabilities = answer.get("probabilities") or {"true": answer["noul"]}
        flat.update({f"{name}/{option}": float(value) for option, value in probabilities.items()})
    return flat


# ------------------------------------------------------------------------------------------------ server


def run_server_phase(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args.server_model)
    variants = {"default": {"dtype": "auto"}, "fp32": {"dtype": "fp32"}}
    servers = {}
    with tempfile.TemporaryDirectory(prefix="bench-dtype-") as logs:
        try:
            for name, flags in variants.items():
                servers[name] = start_clef_server(
                    model,
                    log_path=Path(logs) / f"{name}.log",
                    cache_mb=0,
                    log_level="warning",
                    jobs=False,
                    **flags,
                )
            clients = {
                name: httpx.Client(base_url=server.url, timeout=900) for name, server in servers.items()
            }
            cards = {name: client.get("/v1/models").json()["data"][0] for name, client in clients.items()}
            rng = random.Random(7)
            rounds = []
            for number in range(args.reps):
                bodies = [request(args.words, rng) for _ in range(args.requests)]
                for body in bodies[:1]:  # warm-up of this round's shapes, not timed
                    for client in clients.values():
                        client.post("/v1/systemone", json=body).raise_for_status()
                order = list(variants) if number % 2 == 0 else list(reversed(variants))
                row: dict[str, Any] = {"order": order}
                answers: dict[str, list[dict[str, float]]] = {}
                for name in order:
                    seconds, tokens, answers[name] = [], 0, []
                    for body in bodies:
                        started = time.perf_counter()
                        response = clients[name].post("/v1/systemone", json=body)
                        seconds.append(time.perf_counter() - started)
                        response.raise_for_status()
                        payload = response.json()
                        tokens += int(payload["usage"]["input_tokens"])
                        answers[name].append(flat_probabilities(payload["answers"]))
                    row[name] = {
                        "seconds": round(sum(seconds), 3),
                        "request_s": spread(seconds),
                        "tokens": tokens,
                        "tokens_per_s": round(tokens / sum(seconds), 1),
                    }
                row["speedup"] = round(row["fp32"]["seconds"] / row["default"]["seconds"], 3)
                row["max_abs_dp"] = max(
                    abs(a[key] - b[key])
                    for a, b in zip(answers["default"], answers["fp32"], strict=True)
                    for key in a
                )
                rounds.append(row)
                print(
                    f"server round {number}: speedup {row['speedup']}x, max |dp| {row['max_abs_dp']:.4f}",
                    flush=True,
                )
        finally:
            for server in servers.values():
                server.stop()
    return {
        "model": args.server_model,
        "compute_dtype": {name: card.get("compute_dtype") for name, card in cards.items()},
        "requests_per_round": args.requests,
        "rounds": rounds,
        "speedup": spread(row["speedup"] for row in rounds),
        "max_abs_dp": max(row["max_abs_dp"] for row in rounds),
    }


# ------------------------------------------------------------------------------------------------- drift


def image_url(seed: int, width: int, height: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack(
        [120 + 80 * np.sin(x / 37.0), 100 + 0.2 * y, 140 + 60 * np.cos((x + y) / 23.0)], axis=-1
    )
    pixels += rng.normal(0, 12, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def drift_cases(count: int, images: int, seed: int = 11) -> list[dict[str, Any]]:
    """``count`` text cases of 60 to 1,500 words, then ``images`` cases with two images and a short text."""
    rng = random.Random(seed)
    cases = []
    for number in range(count):
        words = int(60 * (25 ** (number / max(1, count - 1))))  # 60 .. 1,500, spread geometrically
        cases.append({"id": f"text-{number}", **request(words, rng)})
    for number in range(images):
        pictures = [
            image_url(seed + number, 160 + 32 * number, 120),
            image_url(seed + 100 + number, 200, 200),
        ]
        cases.append({"id": f"image-{number}", **request(40, rng, images=pictures)})
    return cases


def compare(
    model: str, cases: list[dict[str, Any]], work: Path, label: str, decisive: float
) -> dict[str, Any]:
    """``clef compare`` of fp32 (a) against bf16 (b) on ``cases``; the drift summary."""
    case_file = work / f"{label}.jsonl"
    case_file.write_text("".join(json.dumps(case) + "\n" for case in cases), encoding="utf-8")
    out = work / f"{label}.json"
    command = [
        sys.executable, "-m", "clef_runtime.cli", "compare", str(case_file),
        "--a", f"model={model},dtype=fp32,cache_mb=0",
        "--b", f"model={model},dtype=bf16,cache_mb=0",
        "--json", str(out), "--batch-size", "4",
    ]  # fmt: skip
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"clef compare failed ({finished.returncode}): {finished.stderr[-2000:]}")
    report = json.loads(out.read_text())
    flips = report["flips"]
    return {
        "cases": len(cases),
        "seconds": round(time.perf_counter() - started, 1),
        "questions": report["questions"],
        "max_abs_dp": report["max_abs_dp"],
        "mean_abs_dp": report["mean_abs_dp"],
        "top1_agreement": report["top1_agreement"],
        "by_type": report["by_type"],
        "flips": len(flips),
        "decisive_margin": decisive,
        "decisive_flips": sum(flip["a_margin"] >= decisive for flip in flips),
        "flip_margins": sorted(round(flip["a_margin"], 4) for flip in flips),
    }


def run_drift_phase(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "command": "clef compare CASES --a model=M,dtype=fp32,cache_mb=0 --b model=M,dtype=bf16,cache_mb=0"
    }
    with tempfile.TemporaryDirectory(prefix="bench-dtype-drift-") as work:
        for name in args.drift_models:
            model = resolve_model(name)
            cases = drift_cases(args.drift_cases, 0 if name == "wide" else args.drift_images)
            groups = {"text": [c for c in cases if c["id"].startswith("text-")]}
            if len(cases) > len(groups["text"]):
                groups["images"] = [c for c in cases if c["id"].startswith("image-")]
            for kind, group in groups.items():
                label = f"{name}/{kind}"
                results[label] = compare(model, group, Path(work), label.replace("/", "-"), args.decisive)
                summary = {key: results[label][key] for key in ("max_abs_dp", "mean_abs_dp", "flips")}
                print(f"drift {label}: {json.dumps(summary)}", flush=True)
    return results


# --------------------------------------------------------------------------------------------- realwidth


def _profile(clef: Any, body: dict[str, Any], top: int = 10) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        clef.decide(body)
    events = sorted(prof.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    return [
        {"op": event.key, "self_s": round(event.self_cpu_time_total / 1e6, 3), "calls": event.count}
        for event in events[:top]
    ]


def run_realwidth_phase(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from devtools.gemm import linear_shapes

    from clef_runtime.engine.clef import Clef

    model = resolve_model(args.realwidth_model)
    rng = random.Random(3)
    modes: dict[str, Any] = {}
    gemm: dict[str, Any] | None = None
    probe = request(args.words, random.Random(5))  # one fixed request: each mode's hidden rows against fp32's
    reference_rows = None
    block_layers = BLOCK_LAYERS
    for mode in args.modes:
        clef = Clef.load(model, cache_mb=0, **REALWIDTH_MODES[mode])
        block_layers = int(clef.backbone.config.num_hidden_layers)
        if gemm is None:  # the block's own Linear shapes at the requests' length, every dtype, same process
            tokens = clef.prepare(request(args.words, random.Random(0))).record.input_tokens
            shapes = [
                GemmShape(min(tokens, clef.step_tokens), i, o) for i, o in linear_shapes(clef.backbone.model)
            ]
            gemm = measure_gemm(shapes, repeats=args.reps)
        clef.decide(request(args.words, rng))  # warm-up
        backbone_s, total_s, tokens_run = [], [], []
        for _ in range(args.reps):
            item = clef.prepare(request(args.words, rng))
            started = time.perf_counter()
            clef.decide_encoded([item])
            total_s.append(time.perf_counter() - started)
            backbone_s.append(clef.last_timings.backbone_s)
            tokens_run.append(item.record.input_tokens)
        row: dict[str, Any] = {
            "options": REALWIDTH_MODES[mode],
            "compute_dtype": clef.card.compute_dtype,
            "weights": clef.card.weight_mode,
            "tokens": statistics.median(tokens_run),
            "request_s": spread(total_s),
            "backbone_s": spread(backbone_s),
        }
        rows = clef.hidden_rows([clef.prepare(probe)])[0]
        if reference_rows is None and mode == "fp32":
            reference_rows = rows
        if reference_rows is not None:
            error = (rows - reference_rows).norm(dim=-1) / reference_rows.norm(dim=-1)
            row["hidden_rows_vs_fp32"] = {
                "relative_l2_median": round(float(error.median()), 5),
                "relative_l2_max": round(float(error.max()), 5),
            }
        if args.profile:
            row["profile"] = _profile(clef, request(args.words, rng))
        modes[mode] = row
        print(f"realwidth {mode}: {row['request_s']['median']} s per request", flush=True)
        del clef
        gc.collect()
    assert gemm is not None
    return {
        "model": args.realwidth_model,
        "block_layers": block_layers,
        "gemm": gemm,
        "gemm_limit": {dtype: gemm_limit(gemm, dtype) for dtype in ("fp32", "bf16", "int8")},
        "modes": modes,
        "projection_9b": project(modes, block_layers),
        "torch_threads": torch.get_num_threads(),
    }


def project(modes: dict[str, Any], block_layers: int) -> dict[str, Any]:
    """9B tokens/s per mode: the request's time outside the backbone once, plus the backbone's time per layer
    times 32 (``int8 late``: 12 fp32 layers + 20 int8 ones, from the fp32 and int8-all runs)."""

    def per_layer(mode: str) -> float:
        return modes[mode]["backbone_s"]["median"] / block_layers

    def rest(mode: str) -> float:
        return modes[mode]["request_s"]["median"] - modes[mode]["backbone_s"]["median"]

    seconds = {mode: rest(mode) + NINE_B_LAYERS * per_layer(mode) for mode in modes if mode != "int8-late"}
    if "fp32" in modes and "int8-all" in modes:
        exact_layers = NINE_B_LAYERS - LATE_INT8_LAYERS
        seconds["int8-late"] = (
            rest("fp32") + exact_layers * per_layer("fp32") + LATE_INT8_LAYERS * per_layer("int8-all")
        )
    tokens = statistics.median(row["tokens"] for row in modes.values())
    rates = {mode: round(tokens / value, 2) for mode, value in seconds.items()}
    base = rates.get("fp32")
    return {
        "tokens": tokens,
        "tokens_per_s": rates,
        "vs_fp32": {mode: round(rate / base, 2) for mode, rate in rates.items()} if base else None,
    }


# -------------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(parser, quick="tiny model, two short rounds, no real-width phase (seconds)")
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--reps", type=int, default=3, help="rounds / timed requests per mode (default 3)")
    parser.add_argument("--requests", type=int, default=4, help="requests per server per round (default 4)")
    parser.add_argument("--words", type=int, default=1000, help="state words per request (~1 token each)")
    parser.add_argument("--server-model", default="medium-1024")
    parser.add_argument("--drift-models", nargs="+", default=["medium", "medium-1024", "wide"])
    parser.add_argument("--drift-cases", type=int, default=24)
    parser.add_argument("--drift-images", type=int, default=4)
    parser.add_argument("--decisive", type=float, default=0.1, help="a decisive question's fp32 top-1 margin")
    parser.add_argument("--realwidth-model", default="wide")
    parser.add_argument("--modes", nargs="+", choices=list(REALWIDTH_MODES), default=list(REALWIDTH_MODES))
    parser.add_argument("--profile", action="store_true", help="also record each real-width mode's top ops")
    args = parser.parse_args(argv)
    if args.quick:
        args.server_model, args.drift_models, args.realwidth_model = "tiny", ["tiny"], "tiny"
        args.reps, args.requests, args.words, args.drift_cases, args.drift_images = 2, 2, 120, 4, 1
        args.phases = (
            [phase for phase in args.phases if phase != "realwidth"] if argv is None else args.phases
        )
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    report = start_report("dtype", __file__, argv, quick=args.quick)
    for phase in args.phases:
        started = time.perf_counter()
        report[phase] = {
            "server": run_server_phase,
            "drift": run_drift_phase,
            "realwidth": run_realwidth_phase,
        }[phase](args)
        report[phase]["phase_s"] = round(time.perf_counter() - started, 1)
    return publish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
