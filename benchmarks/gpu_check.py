"""The prepared check for a machine with one NVIDIA GPU: is the CUDA path right and fast? Exits 0 only if
every check passes.

Runs from the source tree (``PYTHONPATH=src:.`` over the wheels of ``benchmarks/device/wheels.sh``;
docs/gpu.md gives the one command). For ``medium-1024`` (the hidden-1,024 random release; ``--smoke``:
``tiny``), with the fused DeltaNet kernels on and then off (``--no-fused-kernels``):

- **parity**: ``--requests`` generated requests on the device with its defaults (``--dtype auto``: bf16 on
  CUDA; fp32 head) against CPU fp32: max |dp| <= 0.02; fused on against off: max |dp| <= 0.005;
- **burst**: ~``--tokens``-token requests at concurrency 1 and 16, each burst one ``decide_encoded`` call that
  the engine runs in steps as the server does: concurrency 16 must reach >= 2x the tokens/s of 1 on CUDA
  (>= 0.5x on CPU, where a batch gains little);
- **warm-up covers the shapes served**: after ``Clef.warmup(max_rows=16)`` the first 16-request burst takes
  <= 1.5x the median of the later ones (a Triton autotune or a new shape on the first would show);
- **peak device memory** (``torch.cuda.max_memory_allocated``) <= 8 GiB on CUDA;
- **fused kernels from counted calls**: with the ``cuda`` extra installed, fused DeltaNet calls > 0 with the
  kernels on and 0 with them off; without it, the report says so and the reference functions' calls.

Writes ``--json OUT`` (the report with the machine record, GEMM limits on the device, every check with its
value and threshold) and ``OUT`` with ``.md`` (a table). ``--smoke`` runs the same on ``tiny`` with fewer
requests and checks on CPU in under 2 minutes (the test suite runs it); its numbers mean nothing for a GPU,
and off CUDA the timing checks (burst gain, first burst) are recorded but do not decide the exit status.

    python -m benchmarks.gpu_check --device cuda --json benchmarks/results/gpu-check-h200.json
    python -m benchmarks.gpu_check --device cpu --smoke --json /tmp/gpu-check.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from devtools.flags import engine_options
from devtools.models import resolve_model
from devtools.requests import STATE_WORDS, drift, generated_requests
from devtools.results import save, start_report

#: Every check's threshold, by device type where it differs.
PARITY_MAX_DP = 0.02
FUSED_ON_OFF_MAX_DP = 0.005
BURST_GAIN = {"cuda": 2.0, "cpu": 0.5}
FIRST_BURST_RATIO = 1.5
PEAK_MEMORY_GIB = 8.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def request_of_tokens(clef: Any, tokens: int, tag: int) -> dict[str, Any]:
    """A one-question request whose encoding is about ``tokens`` long, with a state of its own (``tag``)."""
    rng = random.Random(tag)
    question = {"q": {"type": "choice", "criteria": {"yes": "it is", "no": "it is not", "maybe": None}}}
    base = clef.encode({"state": "a", "questions": question}).input_tokens
    words = [rng.choice(STATE_WORDS) for _ in range(max(1, tokens - base))]
    return {"state": f"case {tag}: " + " ".join(words), "questions": question}


def probabilities(clef: Any, requests: list[dict[str, Any]]) -> list[list[list[float]]]:
    out = []
    for request in requests:
        out += clef.probabilities_encoded([clef.prepare(request)])
    return out


def burst(
    clef: Any, device: str, tokens: int, concurrency: int, rounds: int, start_tag: int
) -> dict[str, Any]:
    """``rounds`` bursts of ``concurrency`` fresh ~``tokens``-token requests (one ``decide_encoded`` each);
    tokens/s of each, in order (the first is the one right after the warm-up)."""
    seconds, real = [], 0
    for number in range(rounds):
        tag = start_tag + number * concurrency
        items = [clef.prepare(request_of_tokens(clef, tokens, tag + i)) for i in range(concurrency)]
        real = sum(item.record.input_tokens for item in items)
        sync(device)
        started = time.perf_counter()
        clef.decide_encoded(items)
        sync(device)
        seconds.append(time.perf_counter() - started)
    rates = [real / s for s in seconds]
    return {
        "concurrency": concurrency,
        "tokens": real,
        "seconds": [round(s, 4) for s in seconds],
        "tokens_per_s": round(statistics.median(rates), 1),
        "tokens_per_s_samples": [round(r, 1) for r in rates],
    }


def check(name: str, value: Any, passed: bool, threshold: str, gating: bool = True) -> dict[str, Any]:
    """One check's record; a check that is not ``gating`` is reported but does not decide the exit status."""
    return {"check": name, "value": value, "threshold": threshold, "passed": bool(passed), "gating": gating}


def run_device(
    spec: str, fused: bool, args: argparse.Namespace, requests: list[dict[str, Any]]
) -> dict[str, Any]:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.fused import fused_kernels_status, reset_fused_call_counts

    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    clef = Clef.load(spec, engine_options(device=args.device, cache_mb=0, fused_kernels=fused))
    reset_fused_call_counts()
    started = time.perf_counter()
    clef.warmup(max_rows=16)
    sync(args.device)
    warmup_s = time.perf_counter() - started
    started = time.perf_counter()
    clef.decide(requests[0])
    sync(args.device)
    first_s = time.perf_counter() - started
    run: dict[str, Any] = {
        "compute_dtype": clef.card.compute_dtype,
        "dtype_reason": clef.backbone.dtype_reason,
        "weights": clef.card.weight_mode,
        "step_tokens": clef.step_tokens,
        "warmup_s": round(warmup_s, 2),
        "first_request_after_warmup_s": round(first_s, 3),
        "probabilities": probabilities(clef, requests),
        "bursts": [
            burst(clef, args.device, args.tokens, concurrency, args.rounds, start_tag=1000 * concurrency)
            for concurrency in (1, 16)
        ],
        "fused_calls": fused_kernels_status()["calls"],
    }
    if args.device.startswith("cuda"):
        run["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del clef
    gc.collect()
    return run


def check_model(
    name: str, args: argparse.Namespace, requests: list[dict[str, Any]], packages: dict[str, bool]
) -> dict[str, Any]:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.fused import set_fused_kernels

    spec = resolve_model(name)
    reference_clef = Clef.load(spec, engine_options(device="cpu", dtype="fp32", weights="fp32", cache_mb=0))
    started = time.perf_counter()
    reference = probabilities(reference_clef, requests)
    result: dict[str, Any] = {"cpu_fp32_s": round(time.perf_counter() - started, 2)}
    del reference_clef
    gc.collect()
    runs = {}
    for fused in (True, False):
        runs[fused] = run_device(spec, fused, args, requests)
        summary = {k: v for k, v in runs[fused].items() if k != "probabilities"}
        print(
            json.dumps({name: {"fused_on" if fused else "fused_off": summary}}), file=sys.stderr, flush=True
        )
    set_fused_kernels(True)
    device_type = torch.device(args.device).type
    checks = []
    parity = drift(reference, runs[True]["probabilities"])
    checks.append(
        check(
            "parity vs CPU fp32 (fused on)",
            parity,
            parity["max_abs_dp"] <= PARITY_MAX_DP,
            f"max |dp| <= {PARITY_MAX_DP}",
        )
    )
    on_off = drift(runs[True]["probabilities"], runs[False]["probabilities"])
    checks.append(
        check(
            "fused on vs off",
            on_off,
            on_off["max_abs_dp"] <= FUSED_ON_OFF_MAX_DP,
            f"max |dp| <= {FUSED_ON_OFF_MAX_DP}",
        )
    )
    for fused, run in runs.items():
        label = "fused on" if fused else "fused off"
        one, sixteen = run["bursts"]
        gain = sixteen["tokens_per_s"] / one["tokens_per_s"]
        need = BURST_GAIN.get(device_type, BURST_GAIN["cuda"])
        timed = device_type == "cuda"  # on a shared CPU, times are too noisy to gate on
        checks.append(
            check(f"burst gain c=16 / c=1 ({label})", round(gain, 2), gain >= need, f">= {need}", timed)
        )
        later = (
            statistics.median(sixteen["seconds"][1:])
            if len(sixteen["seconds"]) > 1
            else sixteen["seconds"][0]
        )
        ratio = sixteen["seconds"][0] / later
        checks.append(
            check(
                f"first burst after warm-up / later ({label})",
                round(ratio, 2),
                ratio <= FIRST_BURST_RATIO,
                f"<= {FIRST_BURST_RATIO}",
                timed,
            )
        )
        if "peak_memory_gib" in run:
            peak = run["peak_memory_gib"]
            checks.append(
                check(
                    f"peak device memory GiB ({label})",
                    peak,
                    peak <= PEAK_MEMORY_GIB,
                    f"<= {PEAK_MEMORY_GIB}",
                )
            )
    fused_on = sum(c["fused"] for c in runs[True]["fused_calls"].values())
    fused_off = sum(c["fused"] for c in runs[False]["fused_calls"].values())
    if device_type == "cuda" and all(packages.values()):
        checks.append(
            check(
                "fused DeltaNet calls (on, off)",
                [fused_on, fused_off],
                fused_on > 0 and fused_off == 0,
                "on > 0, off == 0",
            )
        )
    else:
        reference_calls = sum(c["reference"] for c in runs[True]["fused_calls"].values())
        why = (
            "on CPU the clef kernels replace the DeltaNet forward"
            if device_type == "cpu"
            else "the cuda extra is not installed"
        )
        checks.append(
            check(
                f"fused DeltaNet calls: none expected ({why})",
                {"fused": fused_on, "reference": reference_calls},
                fused_on == 0 and fused_off == 0,
                "fused == 0",
            )
        )
    for run in runs.values():
        del run["probabilities"]
    result.update(fused_on=runs[True], fused_off=runs[False], checks=checks)
    return result


def render_markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"# gpu_check on {machine['gpu'] or 'CPU (' + machine['cpu'] + ')'}: "
        + ("PASSED" if report["passed"] else "FAILED"),
        "",
        f"torch {machine['torch']['version']}, CUDA {machine['torch']['cuda']}, fused packages "
        f"{report['fused_packages']}, {report.get('wall_s')} s in all; bursts of "
        f"~{report['args']['tokens']}-token requests. GEMM limits on the device: {machine['gemm']['limit']}.",
        "",
        "| model | check | value | threshold | passed |",
        "|---|---|---|---|---|",
    ]
    for model, result in report["models"].items():
        for row in result["checks"]:
            value = row["value"]
            shown = value.get("max_abs_dp", value) if isinstance(value, dict) else value
            passed = ("yes" if row["passed"] else "**no**") + ("" if row["gating"] else " (not gating here)")
            lines.append(f"| {model} | {row['check']} | {shown} | {row['threshold']} | {passed} |")
        for key in ("fused_on", "fused_off"):
            run = result[key]
            rates = ", ".join(f"c={b['concurrency']}: {b['tokens_per_s']} tok/s" for b in run["bursts"])
            lines.append(
                f"| {model} | {key.replace('_', ' ')}: {run['compute_dtype']}, warm-up {run['warmup_s']} s, "
                f"first {run['first_request_after_warmup_s']} s, {rates} | | | |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--json", type=Path, required=True, help="the report (JSON); the table goes beside it as .md"
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument(
        "--smoke",
        "--quick",
        dest="smoke",
        action="store_true",
        help="tiny, few requests: the plumbing (CPU, < 2 min)",
    )
    parser.add_argument("--requests", type=int, default=None, help="parity requests (default 64; smoke 4)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per burst request (512; smoke 128)")
    parser.add_argument("--rounds", type=int, default=None, help="bursts per concurrency (4; smoke 2)")
    args = parser.parse_args(argv)
    args.requests = args.requests or (4 if args.smoke else 64)
    args.tokens = args.tokens or (128 if args.smoke else 512)
    args.rounds = args.rounds or (2 if args.smoke else 4)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(
            "--device cuda: no CUDA device is available (use --device cpu --smoke for a plumbing run)"
        )

    from clef_runtime.model.fused import fused_kernels_status
    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    report = start_report("gpu_check", __file__, argv, quick=args.smoke, device=args.device)
    packages = fused_kernels_status()["packages"]
    report["fused_packages"] = packages
    report["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report["models"] = {}
    requests = generated_requests(args.requests, seed=7)
    for name in ("tiny",) if args.smoke else ("medium-1024",):
        report["models"][name] = check_model(name, args, requests, packages)
    report["passed"] = all(
        row["passed"] for result in report["models"].values() for row in result["checks"] if row["gating"]
    )
    save(report, args.json, "gpu_check")
    markdown = render_markdown(report)
    args.json.with_suffix(".md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
